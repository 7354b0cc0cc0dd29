"""Adapters on a frozen base (registry kind ``adapter``): ``none`` and ``lora`` (docs/skills/lora.md)."""
