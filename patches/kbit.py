"""The k-bit (QLoRA) preparation this toolkit trains with: peft's `prepare_model_for_kbit_training`, except that the
frozen weights of a bf16 base that stay unquantised (embedding, norms, LM head) stay bf16.

peft upcasts them to fp32, and that changes what flows between the layers: an fp32 embedding output, or an fp32 norm
weight times a bf16 input, makes activations fp32; bitsandbytes returns each 4-bit layer's output in its input's
dtype, so q/k/v, the attention output and the residual stream all become fp32 under autocast, and every layer's
checkpointed input takes 4 bytes per feature instead of 2. At long context those checkpoints are the memory floor
(Llama-3.1-8B: 512 instead of 256 KiB per token), so the upcast halves the longest sequence that fits. Kept bf16, the
model runs as any bf16 LoRA fine-tune does: the norms still compute in fp32 inside, the loss in fp32, the LoRA
weights are fp32. A trainable embedding or norm (peft's `modules_to_save`, `--train_embeddings_and_norms`) is peft's
fp32 copy and brings the fp32 activations back, with their memory.
"""
from __future__ import annotations

import torch


def prepare_kbit_model(model, *, use_gradient_checkpointing: bool = True, gradient_checkpointing_kwargs=None):
    """peft's preparation (weights frozen, checkpointing, input grads) with a bf16 base's unquantised weights left
    bf16 (fp16 ones are upcast as peft does: an fp16 residual stream can overflow). Returns the model."""
    from peft import prepare_model_for_kbit_training

    bf16 = [p for p in model.parameters() if p.dtype == torch.bfloat16 and p.__class__.__name__ != "Params4bit"]
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=use_gradient_checkpointing,
                                            gradient_checkpointing_kwargs=gradient_checkpointing_kwargs)
    for param in bf16:
        param.data = param.data.to(torch.bfloat16)
    return model
