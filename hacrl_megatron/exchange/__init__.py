"""exchange stage of hacrl_megatron."""
