"""Text: tokenizers (tiktoken K3, sentencepiece demo), incremental detokenization, K3's chat
rendering and parsing, and the demo tokenizer's trainer."""
