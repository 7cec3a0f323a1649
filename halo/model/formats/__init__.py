"""Model file formats: GGUF files (llama.cpp), llama2.c checkpoints/tokenizers and Hugging Face Llama directories."""
