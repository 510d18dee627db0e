"""eval stage of hacrl_megatron."""
