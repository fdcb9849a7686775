"""``dataset.files`` from a real S3 server (SeaweedFS on 127.0.0.1): nanoGPT's ``meta.pkl`` staged beside the
token arrays of a numpy dataset and verified by its sha256; a wrong one, or one left unnamed, is said."""

from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path

import numpy as np
import pytest

from trainyard.errors import DataError
from trainyard.quality.dataset import check_dataset
from trainyard.spec import FORMAT_SUFFIXES, DataExpectations, DataFile
from trainyard.storage import S3Tier
from trainyard.storage.s3retry import Retry
from trainyard.storage.staging import stage

pytestmark = pytest.mark.integration


def test_a_numpy_dataset_from_s3_brings_its_vocabulary(s3_server, bucket: str, tmp_path: Path) -> None:
    meta = pickle.dumps({"vocab_size": 65, "itos": {i: chr(32 + i) for i in range(65)}})
    objects = {
        "train.bin": (np.arange(2048) % 65).astype(np.uint16).tobytes(),
        "val.bin": (np.arange(256) % 65).astype(np.uint16).tobytes(),
        "meta.pkl": meta,
        "prepare.py": b"# writes train.bin, val.bin and meta.pkl\n",
    }
    client = s3_server.client()
    for key, data in objects.items():  # no sha256 metadata: the server's own checksums, or trust on first fetch
        client.put_object(bucket, f"shakespeare/{key}", io.BytesIO(data), len(data))
    source = S3Tier(f"s3://{bucket}/shakespeare", s3_server.settings, retry=Retry(attempts=3, backoff_s=0.05))
    named = DataFile(name="meta.pkl", sha256=hashlib.sha256(meta).hexdigest(), size=len(meta))

    result = stage(source, tmp_path / "hot", suffixes=FORMAT_SUFFIXES["numpy"], files=[named])
    assert (result.files, result.extra_files, result.unstaged) == (3, 1, 1)
    assert result.warnings == [
        "prepare.py at the source is not staged; name it in dataset.files if the script reads it"
        " (dataset.format numpy stages only its .bin/.npy files)"
    ]
    assert (tmp_path / "hot" / "meta.pkl").read_bytes() == meta
    checked = check_dataset(tmp_path / "hot", DataExpectations(), format="numpy", dtype="uint16", files=[named])
    assert (checked.shards, checked.extra_files) == (2, ["meta.pkl"])

    wrong = DataFile(name="meta.pkl", sha256="f" * 64)
    with pytest.raises(DataError, match=rf"dataset\.files\[0\]\.sha256: meta\.pkl has sha256 {named.sha256},"
                       rf" expected f{{64}}"):  # fmt: skip
        stage(source, tmp_path / "hot", suffixes=FORMAT_SUFFIXES["numpy"], files=[wrong])
    with pytest.raises(
        DataError, match=rf"dataset\.files\[0\]\.name: tokenizer\.json is not at the source s3://{bucket}"
    ):
        stage(source, tmp_path / "other", suffixes=FORMAT_SUFFIXES["numpy"], files=[DataFile(name="tokenizer.json")])
