"""Model file formats: GGUF files (llama.cpp), llama2.c checkpoints/tokenizers and Hugging Face Llama directories."""


def layers_past(names, prefix: str, n_layers: int) -> list[int]:
    """The layer numbers of tensors named PREFIX{i}.… with i >= n_layers: weights a file stores for layers its
    metadata does not count (a block count of 1 over two layers ran one layer and gave other tokens, exit 0)."""
    found = set()
    for name in names:
        if name.startswith(prefix):
            number = name[len(prefix):].split(".", 1)[0]
            if number.isdigit() and int(number) >= n_layers:
                found.add(int(number))
    return sorted(found)
