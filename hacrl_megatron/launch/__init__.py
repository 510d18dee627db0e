"""launch stage of hacrl_megatron."""
