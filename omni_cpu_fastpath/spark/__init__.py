"""Spark-X2.5 (``Spark2_5ForCausalLM``, model_type ``spark2_5``) for vLLM, on CPU and GPU.

- ``config``: the transformers config class (registered with ``AutoConfig.register``).
- ``model``: the vLLM model, built from vLLM's own layers.
- ``tool_parser``: the ``spark25`` tool-call parser.
- ``plugin``: the ``vllm.general_plugins`` entry point that registers all three.
- ``checkpoint``: random checkpoints in the released layout, with an offline tokenizer.
- ``reference``: a plain-PyTorch reference written from the released semantics.

Importing this package imports neither vllm nor torch.
"""
