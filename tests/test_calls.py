"""`calls.isolated`: the copy a replayed call runs on is what ``copy.copy`` would make, object by
object, whichever way a class copies itself (the default reduction takes a faster path)."""

import abc

import torch

from autoprec.calls import isolated


class _Plain:
    def __init__(self, t):
        self.t, self.flag, self.items = t, True, [t, {"k": t}]


class _Abstract(abc.ABC):  # abc.ABC declares empty slots, as transformers' cache layers inherit
    def __init__(self, t):
        self.keys, self.device = t, t.device


class _Slotted:
    __slots__ = ("t", "n")

    def __init__(self, t):
        self.t, self.n = t, 3


class _OwnCopy:
    copies = 0

    def __init__(self, t):
        self.t = t

    def __copy__(self):
        type(self).copies += 1
        out = _OwnCopy.__new__(_OwnCopy)
        out.__dict__.update(self.__dict__)
        return out


class _OwnState:
    restores = 0

    def __init__(self, t):
        self.t = t

    def __getstate__(self):
        return dict(self.__dict__)

    def __setstate__(self, state):
        type(self).restores += 1
        self.__dict__.update(state)


def test_each_kind_of_object_is_copied_as_copy_copy_copies_it_with_its_tensors_replaced():
    t = torch.ones(2)
    marked = lambda x: x + 1  # noqa: E731  (a copy_tensor whose result is told from the original)
    plain = isolated(_Plain(t), marked)
    assert type(plain) is _Plain and plain.flag is True and torch.equal(plain.t, t + 1)
    assert plain.items[0] is plain.t and plain.items[1]["k"] is plain.t  # one tensor reached thrice, one copy
    abstract = isolated(_Abstract(t), marked)
    assert type(abstract) is _Abstract and torch.equal(abstract.keys, t + 1) and abstract.device == t.device
    slotted = _Slotted(t)
    assert isolated(slotted, marked) is slotted  # no __dict__: kept as it is
    before = _OwnCopy.copies
    own = isolated(_OwnCopy(t), marked)
    assert _OwnCopy.copies == before + 1 and torch.equal(own.t, t + 1)  # its own __copy__ ran
    before = _OwnState.restores
    state = isolated(_OwnState(t), marked)
    assert _OwnState.restores == before + 1 and torch.equal(state.t, t + 1)  # copied by copy.copy: its __setstate__ ran


def test_a_cycle_through_a_copied_object_points_at_the_copy():
    a = _Plain(torch.zeros(1))
    a.items.append(a)
    out = isolated(a, torch.Tensor.clone)
    assert out is not a and out.items[2] is out
