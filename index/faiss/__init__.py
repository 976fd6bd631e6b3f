"""The FAISS backend: a collection is a named folder under the data directory (:mod:`.collection`:
the folder's layout and commit protocol, :class:`FaissCollection`, the :data:`BACKEND` that
:mod:`index.backends` names).

Its pieces: the vector stores behind one interface (:mod:`.vectors`): one FAISS index for a
single-vector collection (:mod:`.single`), append-only token segments with exact MaxSim for a
multi-vector one (:mod:`.multi`) and the single-vector rows it keeps for ``two_stage`` candidates
(:mod:`.companion`); the SQLite document store that is also the commit point (:mod:`.docstore`);
the folders' creation, listing and deletion (:mod:`.folders`); and the locks between threads and
processes (:mod:`.locks`).
"""

from .collection import BACKEND, FaissCollection

__all__ = ["FaissCollection", "BACKEND"]
