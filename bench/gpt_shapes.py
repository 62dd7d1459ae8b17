"""The parameter shapes of models/gpt.cpp's GPT, for the analytic memory figures of the
benchmark scripts (memory_table.py, vs_pytorch.py)."""
import math


def gpt_param_shapes(n_embd, vocab, seq):
    """(rows, cols) of every parameter of one block (in registration order), and of the root
    unit (token and position embeddings, final LayerNorm; the head is tied to the embedding)."""
    c = n_embd
    block = [(c, 1), (c, 1), (3 * c, c), (3 * c, 1), (c, c), (c, 1), (c, 1), (c, 1),
             (4 * c, c), (4 * c, 1), (c, 4 * c), (c, 1)]
    root = [(vocab, c), (seq, c), (c, 1), (c, 1)]
    return block, root


def padded(shapes, n):
    """Elements of one rank's shard of these parameters over n ranks: each is split along its
    rows, padded to a multiple of n."""
    return sum(math.ceil(r / n) * c for r, c in shapes)
