"""Families: the machinery several methods share, so that a method's module imports families and never another
method's module (tests/unit/test_architecture.py checks it).

- `averaging`: a server that averages what the clients upload, weighted (FedAvg and the methods built on it).
- `consensus`: the running mean over all m clients' latest messages of the ADMM methods, their diagnostics (the
  augmented Lagrangian), and FLAME's update of a chunk's w_i and pi_i in one compiled pass.
- `split`: models split into a shared and a personal part (partial personalization), by layer presets.
- `shared_part`: the methods that train the personal part first, then the shared part the server averages.
- `dynamic`: the dynamic regularization of FedDyn, the local solver FedSLR's Phase I takes.
- `lowrank`: a global model kept low-rank by a nuclear-norm proximal step on the server (FedSLR and its ablations).
- `teacher`: a model pretrained on the server's own samples (AugFL's teacher, the PM-aided baselines' encoders).
"""
