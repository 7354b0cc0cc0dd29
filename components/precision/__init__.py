"""Training precision policies (registry kind ``precision``): bf16 (baseline) and fp8."""
