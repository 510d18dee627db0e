"""reward stage of hacrl_megatron."""
