"""MoE components: dispatch/combine backends (moe_comm) and overlap schedules (moe_chunk)."""
