"""models stage of hacrl_megatron."""
