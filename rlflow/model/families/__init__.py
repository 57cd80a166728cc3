"""The model families: one module per family, a folder for a family with private parts.

    qwen25vl.py     Qwen2.5-VL (and the shared Qwen-VL base class)
    qwen2vl.py      Qwen2-VL
    qwen_text.py    text-only Qwen (Qwen2/Qwen3 dense)
    qwen3_moe.py    text-only Qwen3-MoE
    qwen3vl/        Qwen3-VL: the family (__init__.py), its megatron model (model.py) and
                    DeepStack (deepstack.py)
    qwen3vl_moe.py  Qwen3-VL-MoE, on Qwen3-VL's folder

Each is registered by one line in rlflow/model/family.py `_FAMILY_MODULES`
(docs/adding-a-model-family.md).
"""
