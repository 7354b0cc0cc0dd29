"""How published weights reach the generator (registry.yaml kind ``transport``, ``publish.transport``):
``hf_folder`` (HF folders, the baseline), ``vllm_ipc`` and ``vllm_nccl`` (in memory, to a vLLM engine)."""
