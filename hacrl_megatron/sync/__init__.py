"""sync stage of hacrl_megatron."""
