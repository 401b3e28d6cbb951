"""Input streams: local text, TensorFlow Datasets and synthetic tasks; tokenizers.

Every stream yields numpy batches `(inputs, targets, weights)` holding this process's rows
of a global batch; language-model data is already shifted (`inputs = w[:-1]`,
`targets = w[1:]`).

- `inputs`: the stream contract, `Batch` and `Inputs`;
- `batching`: global batches, per-process slices and language-model windows;
- `corpus`: the text of the language-model streams (local files or the embedded default)
  and the one UTF-8 check of text files;
- `text`: the language-model stream over local text (`TextFiles`);
- `tfds`: streams from TensorFlow Datasets (the optional ``tfds`` extra);
- `synthetic`: the copy task and uniform random tokens;
- `tokenizers`: text to token ids and back (bytes, SentencePiece);
- `sentencepiece_training`: training a SentencePiece model, with one check of its options
  for every route (Python, gin, `revtrain-tokenizer`).
"""

from revtrain.data.batching import ProcessSlice, lm_batch
from revtrain.data.corpus import default_corpus
from revtrain.data.inputs import Batch, Inputs, StreamInputs
from revtrain.data.sentencepiece_training import train_sentencepiece, trained_sentencepiece
from revtrain.data.synthetic import CopyTask, SyntheticSequences
from revtrain.data.text import TextFiles
from revtrain.data.tfds import TFDS
from revtrain.data.tokenizers import (
    ByteTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
)

__all__ = [
    "TFDS",
    "Batch",
    "ByteTokenizer",
    "CopyTask",
    "Inputs",
    "ProcessSlice",
    "SentencePieceTokenizer",
    "StreamInputs",
    "SyntheticSequences",
    "TextFiles",
    "Tokenizer",
    "default_corpus",
    "lm_batch",
    "train_sentencepiece",
    "trained_sentencepiece",
]
