"""agents stage of hacrl_megatron."""
