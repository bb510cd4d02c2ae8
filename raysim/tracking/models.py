"""The final models a finished run saves (tracking.save_models): the global model as an MLflow PyTorch model that
`mlflow.pytorch.load_model("runs:/RUN_ID/global_model")` opens, the clients' models as one array file; a reader
evaluates a run from them without training it again."""

from __future__ import annotations

import logging
import os
import shutil
import zipfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from raysim.models.flat import ModelSpec

GLOBAL_MODEL = "global_model"
"""The artifact folder of the global model (an MLflow model: MLmodel, data/model.pth, its environment files)."""
CLIENT_MODELS = "client_models.npz"
"""The clients' models: `client_id` (int64) and `params` (float32, clients x parameters), row i client_id[i]'s."""


def global_module(spec: ModelSpec, params: np.ndarray) -> torch.nn.Module:
    """The run's network (`model.name`) holding the flat vector `params`, in eval mode: the function the hosts
    scored as the GM, on inputs normalized as the hosts give them (raysim.api.Result.test_data), its running
    statistics (BatchNorm's; none in most of the zoo) from the vector too."""
    import torch

    network = spec.build()
    vector = torch.from_numpy(np.array(params, dtype=np.float32))
    if vector.numel() != network.size:
        raise ValueError(f"a global model of {vector.numel()} values for model {spec.name!r} of {network.size}")
    network.module.load_state_dict(network.spec.unflatten(vector), strict=False)
    return network.module.eval()


def save_global_model(spec: ModelSpec, params: np.ndarray, path: Path) -> None:
    """Write the global model to the folder `path` as an MLflow PyTorch model: the whole module pickled, so that
    load_model gives it back without raysim for a network of torch's own layers (mlr, mlp, cnn); one of other classes
    (torchvision's resnet18_gn, raysim's multimodal networks, a plugin's) needs their modules importable where it is
    loaded, and loading a pickle runs code: load runs of a store you trust. The requirements are named, not
    inferred: MLflow infers them by loading the model in a subprocess, about a minute. They are the installed
    versions, so MLflow's check of them against this environment, which lists the files of every installed
    distribution (0.6 s of CPU on every run's way out), is left out (`_unchecked_requirements`)."""
    from importlib.metadata import version

    import mlflow
    import mlflow.pytorch
    import torch
    from packaging.version import Version

    # torch's public version: a local label (2.13.0+cpu) is not installable from PyPI (MLflow would warn and drop it)
    requirements = [
        f"torch=={Version(torch.__version__).public}",
        f"cloudpickle=={version('cloudpickle')}",
        f"mlflow=={mlflow.__version__}",
    ]
    module = global_module(spec, params)
    try:
        os.getcwd()  # MLflow reads it while parsing the requirements
    except FileNotFoundError:  # a Ray job's driver on a cluster found its working folder gone by the run's end
        os.chdir(path.parent)
    flavor = logging.getLogger("mlflow.pytorch")
    level = flavor.level
    flavor.setLevel(logging.ERROR)  # its warning that pickles run code when loaded, on every run's console
    try:
        with _unchecked_requirements():
            mlflow.pytorch.save_model(module, str(path), pip_requirements=requirements, serialization_format="pickle")
    finally:
        flavor.setLevel(level)


@contextmanager
def _unchecked_requirements() -> Iterator[None]:
    """Inside: MLflow's save_model does not compare the requirements it is given with the installed packages
    (`mlflow.utils.environment.warn_dependency_requirement_mismatches`, MLflow 2.x and 3.x; a version without it
    checks as it does), a check that can only warn, and cannot for requirements read from the installed versions
    (`save_global_model`)."""
    from mlflow.utils import environment

    check = getattr(environment, "warn_dependency_requirement_mismatches", None)
    if check is None:
        yield
        return
    environment.warn_dependency_requirement_mismatches = _pinned_from_this_environment
    try:
        yield
    finally:
        environment.warn_dependency_requirement_mismatches = check


def save_client_models(blocks: Iterable[tuple[np.ndarray, np.ndarray]], path: Path) -> None:
    """Write the clients' models as CLIENT_MODELS says, uncompressed (float32 parameters barely compress), from
    (client ids, rows) blocks in id order, one block in memory at a time: the rows go to a scratch file beside `path`
    first (the archive's header needs their count), then into the archive. The file is the one `np.savez` writes.
    Gathered whole, 1,000 MLP clients' models took 1.7 GB more at the run's end than its rounds (issue 49)."""
    scratch = path.with_name(path.name + ".rows")
    ids, width = [], 0
    try:
        with scratch.open("wb") as rows_file:
            for block_ids, rows in blocks:
                rows = np.ascontiguousarray(rows, dtype=np.float32)
                ids.append(np.asarray(block_ids, dtype=np.int64))
                width = rows.shape[1]
                rows_file.write(rows.data)
        client_id = np.concatenate(ids) if ids else np.zeros(0, np.int64)
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)), "fortran_order": False}
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            with archive.open("client_id.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, client_id)
            with archive.open("params.npy", "w", force_zip64=True) as member, scratch.open("rb") as rows_file:
                np.lib.format.write_array_header_1_0(member, {**header, "shape": (len(client_id), width)})
                shutil.copyfileobj(rows_file, member, 2**24)
    finally:
        scratch.unlink(missing_ok=True)


def _pinned_from_this_environment(model_requirements: list[str]) -> None:
    """MLflow's mismatch check while `_unchecked_requirements` holds: nothing to compare."""
