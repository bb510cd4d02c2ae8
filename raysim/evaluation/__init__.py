"""Evaluation: how clients' models are scored and summarized, between the models (below) and the runtime (above).

`batched` scores a FlatModel on many groups of samples and parameter vectors at once (torch); `classification` gives
F1 and AUC; `clients` scores a host's clients on their splits; `records` holds a client's scores (PM, GM, HM);
`columns` carries them, and the round's client records, as Arrow columns; `summaries` reduces them across clients.
Nothing here imports the runtime or tracking, and only `batched` and `clients` import torch."""
