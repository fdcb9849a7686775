"""Writes data/tiny_char/{train,val}.bin and meta.pkl as nanoGPT's data/shakespeare_char/prepare.py does."""

import os
import pickle
import sys

import numpy as np

TEXT = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. " * 400


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    chars = sorted(set(TEXT))
    stoi = {ch: i for i, ch in enumerate(chars)}
    ids = np.array([stoi[c] for c in TEXT], dtype=np.uint16)
    n = int(len(ids) * 0.9)
    ids[:n].tofile(os.path.join(out, 'train.bin'))
    ids[n:].tofile(os.path.join(out, 'val.bin'))
    with open(os.path.join(out, 'meta.pkl'), 'wb') as f:
        pickle.dump({'vocab_size': len(chars), 'itos': dict(enumerate(chars)), 'stoi': stoi}, f)


if __name__ == '__main__':
    main(sys.argv[1])
