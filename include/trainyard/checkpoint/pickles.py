"""Which globals a framework's ``torch.save`` pickle may name: an allow-list, by exact name and file name.

A ``.pt``/``.bin``/``.ckpt`` file is a pickle; whoever loads it with ``torch.load(weights_only=False)`` (the
published checkpoint's consumers, a framework resuming) calls every global it names. A deny-list of
"modules that run code" cannot be complete (``timeit.timeit``, ``cProfile.run``, ``pydoc.pipepager``,
numpy's ``runstring`` all run a string), so a file may name only what real saves name, found by saving them
(torch's weights-only set, numpy arrays and RNG state, ``argparse.Namespace``; Hugging Face's
``TrainingArguments`` family only in ``training_args.bin``, Lightning's only in a ``.ckpt``). Anything else is
refused by its full name, the file never loaded.

Names are matched whole: ``posixpath`` + ``os.system`` (protocol 4's ``STACK_GLOBAL``, where the name may be
dotted) is ``posixpath.os.system``, on no list. They are found by ``globals_in``, an unpickler whose every
global is an inert stand-in, so it sees each name as a real unpickler would look it up (memo tricks
included) and builds nothing. Torch-free; the inspector (``checkpoint.torchfiles``) loads what passes.
"""

from __future__ import annotations

import fnmatch
import io
import pickle
import zipfile
from collections.abc import Iterable
from typing import Any

TORCH_FILES = (".pt", ".pth", ".bin", ".ckpt")
"""The file names a framework's ``torch.save`` writes (HF's ``.pt``/``.pth``/``.bin``, Lightning's ``.ckpt``)."""
# numpy 1.x and 2.x spell the module differently; both only build arrays and scalars from bytes.
NUMPY = frozenset(
    {
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
        "numpy.ndarray",
        "numpy.dtype",
    }
)
"""numpy arrays, dtypes and scalars: ``np.random.get_state()`` in HF's ``rng_state.pth`` and users' saves."""
PLAIN = frozenset({"argparse.Namespace"})
"""Objects with no behaviour that scripts save beside their weights (parsed arguments, hyper-parameters)."""
HF_TRAINING_ARGS = frozenset(
    {
        "transformers.training_args.TrainingArguments",
        "transformers.training_args_seq2seq.Seq2SeqTrainingArguments",
        "transformers.training_args.OptimizerNames",
        "transformers.training_args.ParallelMode",
        "transformers.trainer_utils.IntervalStrategy",
        "transformers.trainer_utils.SaveStrategy",
        "transformers.trainer_utils.HubStrategy",
        "transformers.trainer_utils.SchedulerType",
        "transformers.trainer_utils.FSDPOption",
        "transformers.trainer_pt_utils.AcceleratorConfig",
        "transformers.debug_utils.DebugOption",
        "transformers.generation.configuration_utils.GenerationConfig",
        "accelerate.state.PartialState",
        "accelerate.utils.dataclasses.DistributedType",
    }
)
"""What ``Trainer`` pickles in ``training_args.bin`` (its arguments, their enums, accelerate's state)."""
LIGHTNING = frozenset(
    {
        "lightning.fabric.utilities.data.AttributeDict",
        "pytorch_lightning.utilities.parsing.AttributeDict",
        "lightning_fabric.utilities.data.AttributeDict",
    }
)
"""Lightning's hyper-parameter dict, in a ``.ckpt``'s ``hyper_parameters``."""

# (file name pattern, extra names): a file's allow-list is torch's weights-only set plus every row it matches.
BY_FILE: tuple[tuple[str, frozenset[str]], ...] = (
    ("*", NUMPY | PLAIN),
    ("training_args.bin", HF_TRAINING_ARGS),
    ("*.ckpt", LIGHTNING),
)


def allowed(rel: str, weights_only: Iterable[str]) -> frozenset[str]:
    """The globals ``rel`` (a path in the checkpoint) may name, given torch's weights-only set."""
    name = rel.rsplit("/", 1)[-1]
    extra = [names for pattern, names in BY_FILE if fnmatch.fnmatchcase(name, pattern)]
    return frozenset(weights_only).union(*extra)


class NotAPickle(ValueError):
    """The file is not a ``torch.save`` zip with one readable pickle; the message says why."""


class _StandIn:
    """What every global becomes while names are collected: built, called, indexed and filled, it does nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> _StandIn:
        return _StandIn()

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Collector(pickle.Unpickler):
    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self.names: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.names.add(f"{module}.{name}")
        return _StandIn

    def persistent_load(self, pid: Any) -> Any:
        return _StandIn()


def data_pickle(raw: bytes) -> bytes:
    """The pickle of a ``torch.save`` zip (``<archive>/data.pkl``); ``NotAPickle`` if there is not exactly one."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as archive:
            found = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
            if len(found) != 1:
                raise NotAPickle(f"{len(found)} data.pkl records (torch.save writes one)")
            return archive.read(found[0])
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise NotAPickle(f"not a torch.save zip ({exc})") from None


def globals_in(data: bytes) -> set[str]:
    """Every global the pickle names (``module.qualname``, whole), nothing built; ``NotAPickle`` if unreadable."""
    collector = _Collector(data)
    try:
        collector.load()
    except RecursionError:
        raise NotAPickle("nested too deeply") from None
    except Exception as exc:
        raise NotAPickle(f"not a readable pickle ({type(exc).__name__}: {str(exc)[:200]})") from None
    return collector.names
