"""Reading the model file: the GGUF reader, its fields, finiteness checks, split files, the
tokenizer and the chat template's sandbox."""
