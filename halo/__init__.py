"""halo: distributed LLM inference for weak, mixed edge devices over lossy networks."""

from importlib import resources as _resources

__version__ = "0.1.0"

#: The bundled stories260K model (llama2.c format) and its tokenizer: the embedded default.
BUNDLED_MODEL = _resources.files("halo") / "assets" / "stories260K" / "stories260K.bin"
BUNDLED_TOKENIZER = _resources.files("halo") / "assets" / "stories260K" / "tok512.bin"
