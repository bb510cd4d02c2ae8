"""The multimodal networks of FedAPM's experiments (FedAPM, App. B.2) and their building blocks, for any model to use.

A multimodal model receives packed rows (n, width) (raysim.data.modalities) and unpacks them into its named inputs
(`unpack`). The blocks are those of the authors' code (FedMultimodal's): a three-layer Conv1d encoder, GRUs that
skip a sequence's padding, and the attention fusion `FuseBaseSelfAttention` over the modalities' concatenated time
steps with the padding masked. Dropout is 0.1 as in the code; raysim.models.flat draws its masks from each client's
stream during training and turns it off for evaluation, so results stay a function of the seed.

The parameter order is the code's: the tensors that the code's `layer_num` counts as personal come first
(ImageTextClassifier 8, HARClassifier 12, MMActionClassifier 14; FedAPM, App. B.2).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from raysim.data.modalities import Modalities

DROPOUT = 0.1
"""The dropout of the authors' multimodal models (their code; the paper states none)."""

Unpacked = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]
"""Each modality's values [n, *shape] and each sequence's lengths [n] (int64, at least 1)."""


def unpack(x: torch.Tensor, modalities: Modalities) -> Unpacked:
    """The named inputs of packed rows; a length below 1 (a row of zeros, as the batched executor's padding) counts
    as 1, so that every sample has a step to attend to."""
    n = len(x)
    values = {p.name: x[:, modalities.columns(p.name)].reshape(n, *p.shape) for p in modalities.parts}
    lengths = {
        p.name: x[:, modalities.length_column(p.name)].round().long().clamp(1, p.shape[0])
        for p in modalities.parts
        if p.sequence
    }
    return values, lengths


def needs_modalities(model: str, input_shape: tuple[int, ...], names: tuple[str, ...]) -> Modalities:
    """The Modalities of the input, or a ValueError naming the model and the modalities it needs."""
    if not isinstance(input_shape, Modalities) or any(name not in input_shape for name in names):
        raise ValueError(
            f"model.name={model} needs a dataset with the modalities {', '.join(names)} (such as "
            f"{SUBSTITUTES.get(model, 'a multimodal dataset')}), got samples of shape {input_shape}"
        )
    return input_shape


SUBSTITUTES = {
    "image_text_classifier": "dataset.name=crisismmd_synthetic",
    "image_text_classifier_paper": "dataset.name=crisismmd_synthetic",
    "har_classifier": "dataset.name=kuhar_synthetic",
    "mm_action_classifier": "dataset.name=cremad_synthetic",
}
"""The offline dataset each model runs on, for the message of a model given the wrong data."""


def time_mask(lengths: torch.Tensor | None, steps: int, n: int) -> torch.Tensor:
    """[n, steps] True on a sequence's real steps (all of them without lengths)."""
    if lengths is None:
        return torch.ones((n, steps), dtype=torch.bool)
    return torch.arange(steps)[None, :] < lengths[:, None]


def run_gru(rnn: nn.GRU, x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """The GRU's outputs at every step [n, T, hidden]; with lengths, over each sequence's real steps only (packed, as
    the authors' code) and zero beyond them."""
    if lengths is None:
        return rnn(x)[0]
    packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
    return pad_packed_sequence(rnn(packed)[0], batch_first=True, total_length=x.shape[1])[0]


class Conv1dEncoder(nn.Module):
    """Conv1d(features -> f -> 2f -> 4f, kernel 5, padding 2), each followed by ReLU, MaxPool(2) and dropout, over
    a sequence [n, T, features] -> [n, T // 8, 4f] (FedAPM, App. B.2: HAR and Crema-D)."""

    def __init__(self, features: int, filters: int = 32, dropout: float = DROPOUT):
        super().__init__()
        self.conv1 = nn.Conv1d(features, filters, kernel_size=5, padding=2)
        self.conv2 = nn.Conv1d(filters, filters * 2, kernel_size=5, padding=2)
        self.conv3 = nn.Conv1d(filters * 2, filters * 4, kernel_size=5, padding=2)
        self.pool = nn.MaxPool1d(2)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x.transpose(1, 2)
        for conv in (self.conv1, self.conv2, self.conv3):
            hidden = self.dropout(self.pool(torch.relu(conv(hidden))))
        return hidden.transpose(1, 2)

    @staticmethod
    def lengths(lengths: torch.Tensor | None) -> torch.Tensor | None:
        """A sequence's length after the three poolings (at least 1)."""
        return None if lengths is None else (lengths // 8).clamp(min=1)


class FuseBaseSelfAttention(nn.Module):
    """Attention pooling over the concatenated time steps of the modalities: Linear(d_hid -> 512)-Tanh-dropout-
    Linear(512 -> d_head) scores, softmax over the real steps (padding masked), d_head weighted sums of the steps
    -> a d_head * d_hid vector (the authors' FuseBaseSelfAttention, FedAPM, App. B.2)."""

    def __init__(self, d_hid: int, d_head: int, dropout: float = DROPOUT):
        super().__init__()
        self.att_fc1 = nn.Linear(d_hid, 512)
        self.att_fc2 = nn.Linear(512, d_head)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [n, T, d_hid], mask [n, T] (True on real steps) -> [n, d_head * d_hid]."""
        scores = self.att_fc2(self.dropout(torch.tanh(self.att_fc1(x)))).transpose(1, 2)  # [n, d_head, T]
        weights = torch.softmax(scores.masked_fill(~mask[:, None, :], float("-inf")), dim=2)
        return self.dropout(torch.matmul(weights, x)).reshape(len(x), -1)


def classifier(features: int, classes: int, hidden: int = 64, dropout: float = DROPOUT) -> nn.Sequential:
    """Linear(features -> 64)-ReLU-dropout-Linear(64 -> classes): the models' head."""
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, classes))


class ImageTextClassifier(nn.Module):
    """CrisisMMD (FedAPM, App. B.2): an image feature vector and a token sequence. Code sizes: img_proj Linear(image ->
    128)-ReLU-dropout-Linear(128 -> 128), GRU(text -> 128), attention d_hid 128, d_head 6, head 768-64-classes
    (545,870 parameters on [1,1280] + [32,512], 8 classes). Paper sizes (`paper`): img_proj Linear(image -> 64)-ReLU-
    dropout, GRU hidden 64, attention d_hid 64, d_head 4."""

    def __init__(
        self, modalities: Modalities, classes: int, paper: bool = False, image: str = "image", text: str = "text"
    ):
        super().__init__()
        self.modalities, self.image, self.text = modalities, image, text
        image_dim = modalities.part(image).size
        text_dim = modalities.part(text).shape[-1]
        d_hid, d_head = (64, 4) if paper else (128, 6)
        if paper:
            self.img_proj = nn.Sequential(nn.Linear(image_dim, d_hid), nn.ReLU(), nn.Dropout(DROPOUT))
        else:
            self.img_proj = nn.Sequential(
                nn.Linear(image_dim, d_hid), nn.ReLU(), nn.Dropout(DROPOUT), nn.Linear(d_hid, d_hid)
            )
        self.text_rnn = nn.GRU(text_dim, d_hid, batch_first=True)
        self.fuse_att = FuseBaseSelfAttention(d_hid, d_head)
        self.classifier = classifier(d_hid * d_head, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, lengths = unpack(x, self.modalities)
        n = len(x)
        image = self.img_proj(values[self.image].reshape(n, -1)).unsqueeze(1)
        text_lengths = lengths.get(self.text)
        text = run_gru(self.text_rnn, values[self.text], text_lengths)
        mask = torch.cat([time_mask(None, 1, n), time_mask(text_lengths, text.shape[1], n)], dim=1)
        return self.classifier(self.fuse_att(torch.cat([image, text], dim=1), mask))


class HARClassifier(nn.Module):
    """KU-HAR (FedAPM, App. B.2): accelerometer and gyroscope sequences, each through its own Conv1d encoder (3 -> 32 ->
    64 -> 128) and GRU(128 -> 128), attention d_hid 128, d_head 6, head 768-64-classes (420,814 parameters on two
    [256,3] inputs, 8 classes). The paper's sizes are the code's."""

    def __init__(self, modalities: Modalities, classes: int, acc: str = "acc", gyro: str = "gyro"):
        super().__init__()
        self.modalities, self.acc, self.gyro = modalities, acc, gyro
        self.acc_conv = Conv1dEncoder(modalities.part(acc).shape[-1])
        self.gyro_conv = Conv1dEncoder(modalities.part(gyro).shape[-1])
        self.acc_rnn = nn.GRU(128, 128, batch_first=True)
        self.gyro_rnn = nn.GRU(128, 128, batch_first=True)
        self.fuse_att = FuseBaseSelfAttention(128, 6)
        self.classifier = classifier(128 * 6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, lengths = unpack(x, self.modalities)
        steps, masks = [], []
        for name, conv, rnn in ((self.acc, self.acc_conv, self.acc_rnn), (self.gyro, self.gyro_conv, self.gyro_rnn)):
            encoded_lengths = Conv1dEncoder.lengths(lengths.get(name))
            hidden = run_gru(rnn, conv(values[name]), encoded_lengths)
            steps.append(hidden)
            masks.append(time_mask(encoded_lengths, hidden.shape[1], len(x)))
        return self.classifier(self.fuse_att(torch.cat(steps, dim=1), torch.cat(masks, dim=1)))


class MMActionClassifier(nn.Module):
    """Crema-D (FedAPM, App. B.2): MFCC frames through a Conv1d encoder (80 -> 32 -> 64 -> 128) and GRU(128 -> 128),
    video frame features through GRU(1280 -> 128), attention d_hid 128, d_head 6, head 768-64-classes (823,338
    parameters on [600,80] + [6,1280], 4 classes). The paper's sizes are the code's."""

    def __init__(self, modalities: Modalities, classes: int, audio: str = "audio", video: str = "video"):
        super().__init__()
        self.modalities, self.audio, self.video = modalities, audio, video
        self.audio_conv = Conv1dEncoder(modalities.part(audio).shape[-1])
        self.audio_rnn = nn.GRU(128, 128, batch_first=True)
        self.video_rnn = nn.GRU(modalities.part(video).shape[-1], 128, batch_first=True)
        self.fuse_att = FuseBaseSelfAttention(128, 6)
        self.classifier = classifier(128 * 6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, lengths = unpack(x, self.modalities)
        n = len(x)
        audio_lengths = Conv1dEncoder.lengths(lengths.get(self.audio))
        audio = run_gru(self.audio_rnn, self.audio_conv(values[self.audio]), audio_lengths)
        video_lengths = lengths.get(self.video)
        video = run_gru(self.video_rnn, values[self.video], video_lengths)
        mask = torch.cat([time_mask(audio_lengths, audio.shape[1], n), time_mask(video_lengths, video.shape[1], n)], 1)
        return self.classifier(self.fuse_att(torch.cat([audio, video], dim=1), mask))
