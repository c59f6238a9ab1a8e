"""Spark-X2.5 (``Spark2_5ForCausalLM``, model_type ``spark2_5``) for vLLM, on CPU and GPU.

- ``config``: the transformers config class (registered with ``AutoConfig.register``).
- ``model``: the vLLM model, built from vLLM's own layers.
- ``tool_parser``: the ``spark25`` tool-call parser.
- ``plugin``: the ``vllm.general_plugins`` entry point that registers all three.
- ``decode_step``: one decode step with explicit per-layer-type K/V (``torch.export``-able) and its
  host-side ``DecodeState``; ``program``: ``spark export`` / ``spark generate`` (AOTInductor or
  ExecuTorch/XNNPACK, float or 8-/4-bit weights).

Random checkpoints in the released layout (``testing/spark_checkpoint.py``) and the plain-PyTorch
reference written from the released semantics, with mlx-lm beside it
(``testing/spark_reference.py``), live with the other test helpers.

Importing this package imports neither vllm nor torch.
"""
