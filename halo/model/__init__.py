"""What a Llama-family model is and how it is read: its shape (config), its tensors (weights, compact blocks), the
element-wise ops, the file formats, the named-model catalog, tokenizers and chat templates."""
