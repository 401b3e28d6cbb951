"""Streams from TensorFlow Datasets (the optional `tfds` extra).

TensorFlow and tensorflow-datasets are imported when a `TFDS` object is created, never at
`import revtrain.data`, so the rest of the package works without them.

Sharding choice: every process runs the same deterministic tf.data pipeline over the whole
split, batches it into *global* batches and keeps only its own rows (see
`revtrain.data.batching`). That keeps the global batch of each step identical for every
process count (a run resumed on a different number of hosts sees the same data), at the
cost of each process reading and decoding the whole global batch. For datasets where that
cost matters, sharding the files per process (`tfds.split_for_jax_process`) is the
alternative; it gives up the identical-batch property.

The exact eval pass (`TFDS.eval_pass`) is sharded the other way, by examples: its result is
a sum over the split that does not depend on which process scores which example, so each
process reads only its own slice (`tfds.even_splits`; slices differ by at most one
example, their windows by more). Every process must still run the same number of eval
batches (an eval step may be a collective computation, and the processes' sums are added
at the end), so a process whose slice ends first yields all-masked batches until every
process's slice has ended; which is known from one small all-gather of a flag per batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from revtrain.data import batching
from revtrain.data.inputs import Batch, Inputs
from revtrain.data.tokenizers import Tokenizer, check_tokenizer


def _import_tensorflow() -> tuple[Any, Any]:
    """Returns `(tensorflow, tensorflow_datasets)`, hiding GPUs from TensorFlow.

    TensorFlow only feeds data here; if it saw the GPUs it would reserve their memory and
    starve JAX.

    Raises:
      ImportError: Either package is missing; the message names the extra to install.
    """
    try:
        import tensorflow as tf
        import tensorflow_datasets as tfds
    except ImportError as err:
        raise ImportError(
            "revtrain.data.TFDS needs tensorflow and tensorflow-datasets; install them with "
            "`pip install revtrain[tfds-cpu]`, or `pip install revtrain[tfds]` beside the "
            "tensorflow you have"
        ) from err
    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # TensorFlow already initialised its devices; keep its choice.
        pass
    return tf, tfds


def _any_process(flag: bool) -> bool:
    """Whether ``flag`` holds in any JAX process; with several, every process must call.

    One all-gather of a bool (`multihost_utils.process_allgather`); no collective with one
    process.
    """
    import jax  # Lazily, as `batching.ProcessSlice.create`.

    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _zero_rows(spec: Any, tf: Any) -> Any:
    """An endless dataset of all-zero rows shaped as ``spec`` (padding, weight 0).

    Raises:
      ValueError: a row's shape is not static (images of varying sizes).
    """
    def zeros(s: Any) -> Any:
        if not s.shape.is_fully_defined():
            raise ValueError(f"cannot pad eval batches of rows shaped {s.shape}; give the "
                             f"images one fixed shape, or set EvalConfig.steps")
        return tf.zeros(s.shape, s.dtype)

    return tf.data.Dataset.from_tensors(tf.nest.map_structure(zeros, spec)).repeat()


def _detect_keys(features: Any, text_type: type, dataset_name: str) -> tuple[str, ...]:
    """`('image', 'label')` for image classification, else the single text feature."""
    names = list(features.keys())
    if "image" in names and "label" in names:
        return ("image", "label")
    texts = [name for name in names if isinstance(features[name], text_type)]
    if "text" in texts:
        return ("text",)
    if len(texts) == 1:
        return (texts[0],)
    raise ValueError(
        f"cannot tell which features of {dataset_name!r} to use (features: {names}); "
        f"pass keys=('<text feature>',) or keys=('<image feature>', '<label feature>')"
    )


def _pixel_max(dtype: Any) -> float:
    """The value that maps to 1.0: the integer dtype's maximum; 1.0 for float pixels."""
    dtype = np.dtype(dtype)
    return float(np.iinfo(dtype).max) if np.issubdtype(dtype, np.integer) else 1.0


def _default_eval_split(split_names: Sequence[str]) -> str:
    """'validation' when the dataset has it, else 'test' (the usual TFDS split names)."""
    return "validation" if "validation" in split_names else "test"


class TFDS(Inputs):
    """A TensorFlow Datasets dataset as train and eval streams.

    Two kinds of data, chosen by `keys` (auto-detected when None):

    * Text, `keys=(text_feature,)`: each example's text is encoded by `tokenizer` (by
      default its UTF-8 bytes, vocabulary 256; a `SentencePieceTokenizer` gives subword
      ids); its int32 tokens are cut into windows of `sequence_length + 1` tokens that
      advance by `sequence_length` (every token after the first is a target exactly once);
      the last window of an example is padded with 0. The data does the shift:
      `inputs = w[:-1]`, `targets = w[1:]`, int32 `[batch, sequence_length]`; `weights`
      float32 `[batch, sequence_length]` is 0 where the target is padding. Examples are not
      packed together, and examples shorter than 2 tokens give no window.
    * Images, `keys=(image_feature, label_feature)`: `inputs` float32
      `[batch, height, width, channels]` scaled to [0, 1] (integer pixels divided by their
      dtype's maximum), `targets` int32 `[batch]`, `weights` float32 ones `[batch]`. Images
      must have one fixed shape.

    Train stream: files read in a seeded order, repeated forever, shuffled with a seeded
    `shuffle_buffer`, batched to the global batch size, then `skip(start_step)` batches. The
    pipeline is deterministic, so `train_stream(start_step=k)` yields the batches from step
    `k` of `train_stream()`; skipping still reads the skipped examples, so resuming a late
    step costs time proportional to the step. Eval stream: the eval split in file order,
    unshuffled, repeated forever (batches run across the end of the split into its start).
    Exact eval pass (`eval_pass`): the same windows or images once each, read per process
    (see the module docstring).
    The first stream created downloads and prepares the dataset if `data_dir` lacks it
    (`tfds.load`'s default behaviour).

    Attributes:
      tokenizer: the text's `Tokenizer`; None for images.
      vocab_size: the tokenizer's (256 for bytes) for text, None for images.
      n_classes: The label feature's `num_classes` for images, else None.
      keys: The features used.
      eval_split: The split read by `eval_stream`.
    """

    def __init__(
        self,
        dataset_name: str,
        data_dir: str | None = None,
        split: str = "train",
        eval_split: str | None = None,
        keys: Sequence[str] | None = None,
        batch_size: int = 8,
        sequence_length: int | None = None,
        shuffle_buffer: int = 1024,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
        tokenizer: Tokenizer | None = None,
    ):
        """Looks up the dataset and checks the arguments (reading starts in the streams).

        Args:
          dataset_name: A TFDS name, e.g. 'lm1b', 'pg19', 'mnist' or 'cifar10:3.0.2'.
          data_dir: TFDS data directory; None uses TFDS's default.
          split: The train split (any TFDS split string, e.g. 'train[:90%]').
          eval_split: The eval split; None picks 'validation' if the dataset has one,
            else 'test'.
          keys: `(text_feature,)` or `(image_feature, label_feature)`; None detects
            `('image', 'label')`, else the feature 'text', else the only text feature.
          batch_size: The global batch size; must divide by the process count.
          sequence_length: Tokens per text example; required for text, None for images.
          shuffle_buffer: Examples in the train shuffle buffer; 0 disables shuffling.
          seed: Seed of the file order and the shuffle.
          process_index: This process's index; default `jax.process_index()`.
          process_count: Number of processes; default `jax.process_count()`.
          tokenizer: text to ids; None for `ByteTokenizer`. Text only.

        Raises:
          ImportError: tensorflow or tensorflow-datasets is not installed.
          TypeError: `tokenizer` is not a `Tokenizer`.
          ValueError: Bad `keys` or `sequence_length`, `batch_size` not divisible by
            the process count, or a `tokenizer` for image keys.
        """
        self._tf, self._tfds = _import_tensorflow()
        self.shard = batching.ProcessSlice.create(batch_size, process_index, process_count)
        self.dataset_name = dataset_name
        self.data_dir = data_dir
        self.split = split
        self.shuffle_buffer = int(shuffle_buffer)
        self.seed = int(seed)
        builder = self._tfds.builder(dataset_name, data_dir=data_dir)
        features = builder.info.features
        if keys is None:
            keys = _detect_keys(features, self._tfds.features.Text, dataset_name)
        self.keys = tuple(keys)
        self.eval_split = eval_split or _default_eval_split(list(builder.info.splits))
        self.sequence_length = sequence_length
        self.tokenizer = None
        if len(self.keys) == 1:
            self._check_text(sequence_length)
            self.tokenizer = check_tokenizer(tokenizer, "TFDS.tokenizer")
            self.vocab_size, self.n_classes = self.tokenizer.vocab_size, None
            self.byte_level = self.tokenizer.byte_level
        elif len(self.keys) == 2:
            if tokenizer is not None:
                raise ValueError(f"TFDS.tokenizer={tokenizer!r} applies to text only; "
                                 f"unbind it for image keys {self.keys}")
            if sequence_length is not None:
                raise ValueError(
                    f"sequence_length={sequence_length} applies to text only; pass "
                    f"sequence_length=None for image keys {self.keys}"
                )
            self._image_max = _pixel_max(features[self.keys[0]].np_dtype)
            self.vocab_size = None
            self.n_classes = getattr(features[self.keys[1]], "num_classes", None)
        else:
            raise ValueError(
                f"keys={self.keys} must be (text_feature,) or (image_feature, label_feature)"
            )

    def _check_text(self, sequence_length: int | None) -> None:
        if sequence_length is None or sequence_length < 1:
            raise ValueError(
                f"sequence_length={sequence_length} for text dataset "
                f"{self.dataset_name!r}; pass a positive sequence_length, e.g. 128"
            )

    def train_stream(self, start_step: int = 0) -> Iterator[Batch]:
        """Yields train batches for global steps `start_step, start_step + 1, ...`.

        Raises:
          ValueError: `start_step` is negative.
        """
        if start_step < 0:
            raise ValueError(f"start_step={start_step} must be >= 0")
        ds = self._dataset(self.split, train=True).skip(start_step)
        return self._numpy_batches(ds)

    def eval_stream(self) -> Iterator[Batch]:
        """Yields eval batches from the start of the eval split, forever.

        A split without a single window (no text of 2 bytes or more) yields nothing.
        """
        return self._numpy_batches(self._dataset(self.eval_split, train=False))

    def eval_pass(self) -> Iterator[Batch]:
        """Yields one exact pass over this process's slice of the eval split.

        Each window (text) or image of the slice is in exactly one batch, in file order,
        unshuffled; the last batch is filled with all-zero rows of weight 0, and once the
        slice has ended, batches of such rows follow until every process's slice has ended
        (so all processes yield the same number of batches). Batches hold
        `batch_size // process_count` rows, as the other streams. With several processes
        every process must iterate the pass to its end, in step with the others.

        Raises:
          ValueError: for images without one static shape (the padding needs it).
        """
        tf = self._tf
        split = self.eval_split
        if self.shard.process_count > 1:
            split = self._tfds.even_splits(split, n=self.shard.process_count)[
                self.shard.process_index]
        rows = self._rows(split, train=False).map(lambda a, b: (a, b, True))
        ds = rows.concatenate(_zero_rows(rows.element_spec, tf))
        ds = ds.batch(self.shard.local_batch_size).prefetch(tf.data.AUTOTUNE)
        for first, second, real in self._tfds.as_numpy(ds):
            if not _any_process(bool(real.any())):
                return
            yield self._batch(first, second, real)

    def _rows(self, split: str, train: bool) -> Any:
        """One split's examples as rows: (window, mask) for text, (image, label)."""
        tf, tfds = self._tf, self._tfds
        ds = tfds.load(
            self.dataset_name,
            split=split,
            data_dir=self.data_dir,
            shuffle_files=train,
            read_config=tfds.ReadConfig(shuffle_seed=self.seed),
        )
        if len(self.keys) == 1:
            return ds.flat_map(self._text_windows)
        return ds.map(self._image_example, num_parallel_calls=tf.data.AUTOTUNE)

    def _dataset(self, split: str, train: bool) -> Any:
        """The global-batch tf.data pipeline of one split, repeated forever."""
        tf = self._tf
        ds = self._rows(split, train).repeat()
        if train and self.shuffle_buffer > 0:
            ds = ds.shuffle(self.shuffle_buffer, seed=self.seed)
        ds = ds.batch(self.shard.batch_size, drop_remainder=True)
        options = tf.data.Options()
        options.deterministic = True
        return ds.with_options(options)

    def _text_windows(self, example: dict[str, Any]) -> Any:
        """One example's text as a dataset of (int32 windows, bool masks) `[length + 1]`."""
        tf, length = self._tf, self.sequence_length
        text = example[self.keys[0]]
        if self.byte_level:
            tokens = tf.cast(tf.io.decode_raw(text, tf.uint8), tf.int32)
        else:
            tokens = tf.numpy_function(self.tokenizer.encode, [text], tf.int32,
                                       stateful=False)
            tokens.set_shape([None])
        n = tf.size(tokens)
        n_windows = tf.maximum(n + length - 2, 0) // length  # ceil((n - 1) / length).
        tokens = tf.pad(tokens, [[0, tf.maximum(n_windows * length + 1 - n, 0)]])
        positions = tf.range(n_windows)[:, None] * length + tf.range(length + 1)[None, :]
        windows = tf.gather(tokens, positions)
        return tf.data.Dataset.from_tensor_slices((windows, positions < n))

    def _image_example(self, example: dict[str, Any]) -> tuple[Any, Any]:
        tf = self._tf
        image = tf.cast(example[self.keys[0]], tf.float32) / self._image_max
        return image, tf.cast(example[self.keys[1]], tf.int32)

    def _numpy_batches(self, ds: Any) -> Iterator[Batch]:
        """This process's rows of each global batch, as numpy `Batch`es."""
        ds = ds.prefetch(self._tf.data.AUTOTUNE)
        for global_batch in self._tfds.as_numpy(ds):
            yield self._batch(*self.shard.take(global_batch))

    def _batch(self, first: np.ndarray, second: np.ndarray,
               real: np.ndarray | None = None) -> Batch:
        """Rows as a `Batch`; ``real`` (bool `[batch]`) is 0 on padding rows."""
        if len(self.keys) == 1:  # A padding row's mask is all False already.
            return batching.lm_batch(first, second)
        weights = np.ones(second.shape, np.float32) if real is None else real
        return first, second, np.asarray(weights, np.float32)
