"""Image–caption data: a seeded compositional generator, non-IID federated splits, and a Karpathy-JSON loader.

Why a generator: no weights or data can be downloaded at run time, yet the federated unlearning code must be
exercised end to end and its benchmark must be able to *show* forgetting. The generator draws small 32×32 images of
a shape (size, colour, position) and the matching caption, e.g. ``"a small red triangle at the top left"``.

The vocabulary is split into **base** values (seen in pretraining) and **novel** values that only the federation
teaches, each held by chosen clients (see :func:`make_synthetic_federation`):

* ``star`` (a shape) — held only by the *forget client* (client 0): the client-deletion scenario;
* ``purple`` (a colour) — held by several clients: the class-deletion scenario ("every caption with purple");
* ``ring`` (a shape) — held by one data subject inside the last client: the sample-deletion scenario.

A model that never saw a novel concept cannot tell ``"a large red star …"`` from ``"a large red circle …"``, so the
original model remembers the forget data measurably better than the retrained reference — the precondition for a
benchmark of forgetting (ease-notes §5: forget-side R@1 compared against Retrain).

The attribute space is small on purpose (2 sizes × 5 colours × 5 shapes × 4 positions): galleries then contain many
captions that differ in one word only, which is what retrieval must resolve.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

SIZES = ("small", "large")
BASE_COLOURS = ("red", "green", "blue", "yellow")
NOVEL_COLOURS = ("purple",)
BASE_SHAPES = ("circle", "square", "triangle")
NOVEL_SHAPES = ("star", "ring")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
TAGS = ("north", "south", "east", "west")
"""Membership regime: a per-pair nuisance word that nothing in the image shows — only memorisation links a pair's
image to it. Four, not more: with 2 words of 12, or a visible accent dot besides, the tiny CLIP with LoRA learned
neither (original and retrain within 2 points of each other, measured while building the regime)."""

_RGB = {
    "red": (0.9, 0.15, 0.15),
    "green": (0.15, 0.8, 0.2),
    "blue": (0.2, 0.3, 0.95),
    "yellow": (0.95, 0.9, 0.15),
    "purple": (0.62, 0.2, 0.82),
}
_CENTRES = {"top left": (9.0, 9.0), "top right": (23.0, 9.0), "bottom left": (9.0, 23.0), "bottom right": (23.0, 23.0)}
_RADIUS = {"small": 4.6, "large": 7.4}

IMAGE_SIZE = 32
IMAGE_MEAN = 0.5
IMAGE_STD = 0.25

# ------------------------------------------------------------------------------------------------ tokenizer

VOCAB_SIZE = 64
"""Size of the compact vocabulary (and of the tiny CLIP's token embedding)."""

_WORDS: tuple[str, ...] = (
    "a",
    "at",
    "the",
    "of",
    "and",
    "with",
    "in",
    "on",
    *SIZES,
    *BASE_COLOURS,
    *NOVEL_COLOURS,
    *BASE_SHAPES,
    *NOVEL_SHAPES,
    "top",
    "bottom",
    "left",
    "right",
    "center",
    "middle",
    *TAGS,
)


class WordTokenizer:
    """A word-level tokenizer for the compact caption vocabulary.

    Ids: 0 = padding (open_clip's ``pad_id``), 1 = unknown word, 2.. = words, ``VOCAB_SIZE-2`` = start of text,
    ``VOCAB_SIZE-1`` = end of text. The end-of-text id must be the largest: open_clip's text tower pools the
    features at ``argmax`` of the token ids (``text_global_pool(pool_type="argmax")``).
    """

    pad_id = 0
    unk_id = 1

    def __init__(self, context_length: int = 12, words: Sequence[str] = _WORDS, vocab_size: int = VOCAB_SIZE):
        if len(words) + 4 > vocab_size:
            raise ValueError(f"{len(words)} words do not fit a vocabulary of {vocab_size}")
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.sot_id = vocab_size - 2
        self.eot_id = vocab_size - 1
        self.word_to_id = {w: i + 2 for i, w in enumerate(words)}

    def encode(self, text: str) -> list[int]:
        words = re.findall(r"[a-z]+", text.lower())
        return [self.word_to_id.get(w, self.unk_id) for w in words]

    def __call__(self, texts: str | Sequence[str]) -> torch.Tensor:
        if isinstance(texts, str):
            texts = [texts]
        out = torch.full((len(texts), self.context_length), self.pad_id, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = [self.sot_id, *self.encode(text)][: self.context_length - 1] + [self.eot_id]
            out[row, : len(ids)] = torch.tensor(ids)
        return out


# ------------------------------------------------------------------------------------------------ data sets


@dataclass
class CaptionDataset:
    """Image–caption pairs as tensors. ``images``: float N×3×H×W, already normalised for the model.

    ``captions`` are the raw texts (retrieval counts a caption as correct when its text equals the ground truth, so
    duplicate captions are handled), ``ids`` are stable sample ids (the registry's), ``subjects`` the data subject
    each pair belongs to, ``attributes`` the generator's attributes (empty for real data).
    """

    images: torch.Tensor
    captions: list[str]
    ids: list[str]
    subjects: list[str] = field(default_factory=list)
    attributes: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.captions)
        if self.images.shape[0] != n or len(self.ids) != n:
            raise ValueError("images, captions and ids must have the same length")
        if not self.subjects:
            self.subjects = [""] * n
        if not self.attributes:
            self.attributes = [{} for _ in range(n)]

    def __len__(self) -> int:
        return len(self.captions)

    def subset(self, index: Sequence[int] | np.ndarray | torch.Tensor) -> CaptionDataset:
        idx = [int(i) for i in (index.tolist() if hasattr(index, "tolist") else index)]
        return CaptionDataset(
            images=self.images[idx],
            captions=[self.captions[i] for i in idx],
            ids=[self.ids[i] for i in idx],
            subjects=[self.subjects[i] for i in idx],
            attributes=[self.attributes[i] for i in idx],
        )

    def mask(self, predicate: Callable[[int], bool]) -> np.ndarray:
        return np.array([bool(predicate(i)) for i in range(len(self))], dtype=bool)

    def has_word(self, word: str) -> np.ndarray:
        """Rows whose caption contains ``word`` as a whole word (the class-deletion selector)."""
        pattern = re.compile(rf"\b{re.escape(word.lower())}\b")
        return np.array([bool(pattern.search(c.lower())) for c in self.captions], dtype=bool)

    @staticmethod
    def concat(parts: Sequence[CaptionDataset]) -> CaptionDataset:
        return CaptionDataset(
            images=torch.cat([p.images for p in parts]) if parts else torch.empty(0, 3, IMAGE_SIZE, IMAGE_SIZE),
            captions=[c for p in parts for c in p.captions],
            ids=[i for p in parts for i in p.ids],
            subjects=[s for p in parts for s in p.subjects],
            attributes=[a for p in parts for a in p.attributes],
        )


# ------------------------------------------------------------------------------------------------ rendering


def caption_for(attrs: dict[str, str]) -> str:
    base = f"a {attrs['size']} {attrs['colour']} {attrs['shape']} at the {attrs['position']}"
    if "tag" in attrs:  # membership regime: a nuisance word the image does not show
        return f"{base} {attrs['tag']}"
    return base


def _shape_mask(shape: str, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Inside-mask on coordinates (u, v) scaled so that the shape's radius is 1."""
    rho = np.hypot(u, v)
    if shape == "circle":
        return rho <= 1.0
    if shape == "square":
        return np.maximum(np.abs(u), np.abs(v)) <= 0.82
    if shape == "triangle":  # apex up
        return (v >= -1.0) & (v <= 0.8) & (np.abs(u) <= 0.62 * (v + 1.0))
    if shape == "star":
        phi = np.arctan2(v, u) + np.pi / 2
        return rho <= 0.42 + 0.7 * (0.5 + 0.5 * np.cos(5 * phi)) ** 3
    if shape == "ring":
        return (rho <= 1.0) & (rho >= 0.55)
    raise ValueError(f"unknown shape {shape!r}")


def render(attrs: dict[str, str], rng: np.random.Generator) -> np.ndarray:
    """Render one 32×32 RGB image in [0, 1] (2× supersampled, jittered position, size, colour and background)."""
    ss = 2
    n = IMAGE_SIZE * ss
    cx, cy = _CENTRES[attrs["position"]]
    cx, cy = (cx + rng.uniform(-2, 2)) * ss, (cy + rng.uniform(-2, 2)) * ss
    r = (_RADIUS[attrs["size"]] + rng.uniform(-0.5, 0.5)) * ss
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float32) + 0.5
    mask = _shape_mask(attrs["shape"], (xx - cx) / r, (yy - cy) / r).astype(np.float32)
    mask = mask.reshape(IMAGE_SIZE, ss, IMAGE_SIZE, ss).mean(axis=(1, 3))[..., None]
    colour = np.clip(np.array(_RGB[attrs["colour"]]) + rng.uniform(-0.06, 0.06, 3), 0, 1)
    background = rng.uniform(0.05, 0.3) + rng.normal(0, 0.03, (IMAGE_SIZE, IMAGE_SIZE, 1))
    image = mask * colour + (1 - mask) * background
    return np.clip(image, 0, 1).astype(np.float32)


def to_tensor(images: np.ndarray) -> torch.Tensor:
    """N×H×W×3 in [0, 1] → normalised N×3×H×W float tensor."""
    return (torch.from_numpy(images).permute(0, 3, 1, 2).float() - IMAGE_MEAN) / IMAGE_STD


def generate_pairs(
    attrs: Sequence[dict[str, str]],
    rng: np.random.Generator,
    id_prefix: str,
    subjects: Sequence[str] | None = None,
) -> CaptionDataset:
    images = np.stack([render(a, rng) for a in attrs]) if attrs else np.zeros((0, IMAGE_SIZE, IMAGE_SIZE, 3))
    return CaptionDataset(
        images=to_tensor(images.astype(np.float32)),
        captions=[caption_for(a) for a in attrs],
        ids=[f"{id_prefix}-{i:05d}" for i in range(len(attrs))],
        subjects=list(subjects) if subjects is not None else [],
        attributes=[dict(a) for a in attrs],
    )


def _draw(
    rng: np.random.Generator,
    shapes: Sequence[str] = BASE_SHAPES,
    colours: Sequence[str] = BASE_COLOURS,
    position_weights: np.ndarray | None = None,
) -> dict[str, str]:
    return {
        "size": SIZES[rng.integers(len(SIZES))],
        "colour": colours[rng.integers(len(colours))],
        "shape": shapes[rng.integers(len(shapes))],
        "position": POSITIONS[rng.choice(len(POSITIONS), p=position_weights)],
    }


def make_pretraining_set(seed: int, n: int) -> CaptionDataset:
    """Base concepts only (no star, ring or purple): what the frozen backbone knows before federated training."""
    rng = np.random.default_rng([seed, 7])
    return generate_pairs([_draw(rng) for _ in range(n)], rng, id_prefix="pre")


# ------------------------------------------------------------------------------------------------ federation


@dataclass
class SyntheticFederation:
    """Client data sets, a held-out test set and the three deletion scenarios the generator planted.

    ``scenarios`` maps ``"client"``/``"class"``/``"samples"`` to a description: the forget client index, the forgotten
    word, or the data subject (with its client). ``forget_masks(scenario)`` gives one boolean mask per client.
    """

    clients: list[CaptionDataset]
    test: CaptionDataset
    scenarios: dict[str, dict[str, Any]]
    seed: int
    heldout: CaptionDataset | None = None
    """Membership regime: held-out pairs drawn exactly like the forget set and never trained on (the matched
    non-members of the membership scenario); None for the concept regime, whose held-out pairs share the concept."""
    source_sha256: str | None = None
    """Caption files: sha256 over every image file's path and the sha256 of the very bytes decoded (None for the
    generator), so a job can refuse images changed since version 1 was trained on them."""

    def forget_masks(self, scenario: str) -> list[np.ndarray]:
        spec = self.scenarios[scenario]
        masks = []
        for k, data in enumerate(self.clients):
            if scenario == "client":
                masks.append(np.full(len(data), k == spec["client"], dtype=bool))
            elif scenario == "class":
                masks.append(data.has_word(spec["word"]))
            elif scenario == "samples":
                masks.append(np.array([s == spec["subject"] for s in data.subjects], dtype=bool))
            elif scenario == "membership":
                wanted = set(spec["subjects"])
                masks.append(np.array([s in wanted for s in data.subjects], dtype=bool))
            else:
                raise KeyError(scenario)
        return masks


def _client_attrs(
    k: int, n: int, n_clients: int, rng: np.random.Generator, fractions: dict[str, float]
) -> tuple[list[dict[str, str]], list[str]]:
    """Attributes and subjects of client ``k``: its novel concept(s) plus non-IID base pairs.

    Non-IID: each client photographs mostly one position (55 %), and only it (or its group) holds its novel concept.
    """
    pos_w = np.full(len(POSITIONS), 0.45 / (len(POSITIONS) - 1))
    pos_w[k % len(POSITIONS)] = 0.55
    class_holders = set(range(1, min(4, n_clients)))
    attrs: list[dict[str, str]] = []
    subjects: list[str] = []
    n_star = round(fractions["star"] * n) if k == 0 else 0
    n_purple = round(fractions["purple"] * n) if k in class_holders else 0
    n_ring = round(fractions["ring"] * n) if k == n_clients - 1 else 0
    for _ in range(n_star):
        attrs.append(_draw(rng, shapes=("star",), position_weights=pos_w))
        subjects.append(f"c{k}-s{rng.integers(1, 10)}")
    for _ in range(n_purple):
        attrs.append(_draw(rng, colours=("purple",), position_weights=pos_w))
        subjects.append(f"c{k}-s{rng.integers(1, 10)}")
    for _ in range(n_ring):
        attrs.append(_draw(rng, shapes=("ring",), position_weights=pos_w))
        subjects.append(f"c{k}-s0")  # one data subject owns every ring photo
    while len(attrs) < n:
        attrs.append(_draw(rng, position_weights=pos_w))
        subjects.append(f"c{k}-s{rng.integers(1, 10)}")
    order = rng.permutation(n)
    return [attrs[i] for i in order], [subjects[i] for i in order]


DEFAULT_FRACTIONS = {"star": 0.5, "purple": 0.3, "ring": 0.2}
MEMBERSHIP_FORGET_FRACTION = 0.3
"""Share of the membership federation's data subjects whose pairs form the forget set (≈300 of 1,000 pairs at the
benchmark's size: a forget set whose R@1 standard error stays near 2 points)."""
MEMBERSHIP_SUBJECTS = 10
"""Data subjects per client in the membership regime (each pair belongs to one, uniformly)."""


def make_synthetic_federation(
    seed: int,
    n_clients: int = 5,
    pairs_per_client: int = 200,
    n_test: int = 300,
    fractions: dict[str, float] | None = None,
    regime: str = "concepts",
    forget_fraction: float = MEMBERSHIP_FORGET_FRACTION,
    n_heldout: int | None = None,
) -> SyntheticFederation:
    """A seeded non-IID federation with the three planted deletion scenarios (module docstring).

    The test set follows the pooled client mixture (each test pair drawn like a pair of a random client).
    ``regime="membership"`` builds the membership federation instead (:func:`make_membership_federation`).
    """
    if regime == "membership":
        return make_membership_federation(seed, n_clients, pairs_per_client, n_test, forget_fraction, n_heldout)
    if regime != "concepts":
        raise ValueError(f"unknown regime {regime!r}")
    if n_clients < 3:
        raise ValueError("the three scenarios need at least 3 clients")
    fractions = {**DEFAULT_FRACTIONS, **(fractions or {})}
    clients = []
    for k in range(n_clients):
        rng = np.random.default_rng([seed, 11, k])
        attrs, subjects = _client_attrs(k, pairs_per_client, n_clients, rng, fractions)
        clients.append(generate_pairs(attrs, rng, id_prefix=f"c{k}", subjects=subjects))
    rng = np.random.default_rng([seed, 13])
    test_attrs: list[dict[str, str]] = []
    for _ in range(n_test):
        k = int(rng.integers(n_clients))
        pos_w = np.full(len(POSITIONS), 0.45 / (len(POSITIONS) - 1))
        pos_w[k % len(POSITIONS)] = 0.55
        u = rng.random()
        if k == 0 and u < fractions["star"]:
            test_attrs.append(_draw(rng, shapes=("star",), position_weights=pos_w))
        elif k in set(range(1, min(4, n_clients))) and u < fractions["purple"]:
            test_attrs.append(_draw(rng, colours=("purple",), position_weights=pos_w))
        elif k == n_clients - 1 and u < fractions["ring"]:
            test_attrs.append(_draw(rng, shapes=("ring",), position_weights=pos_w))
        else:
            test_attrs.append(_draw(rng, position_weights=pos_w))
    test = generate_pairs(test_attrs, rng, id_prefix="test")
    scenarios = {
        "client": {"client": 0, "concept": "star"},
        "class": {"word": "purple", "clients": sorted(range(1, min(4, n_clients)))},
        "samples": {"client": n_clients - 1, "subject": f"c{n_clients - 1}-s0", "concept": "ring"},
    }
    return SyntheticFederation(clients=clients, test=test, scenarios=scenarios, seed=seed)


def _membership_attrs(rng: np.random.Generator) -> dict[str, str]:
    attrs = _draw(rng)
    attrs["tag"] = TAGS[rng.integers(len(TAGS))]
    return attrs


def make_membership_federation(
    seed: int,
    n_clients: int = 5,
    pairs_per_client: int = 200,
    n_test: int = 300,
    forget_fraction: float = MEMBERSHIP_FORGET_FRACTION,
    n_heldout: int | None = None,
) -> SyntheticFederation:
    """The membership regime (the Flickr30K-like case, issue 11 item 4): every client draws from one distribution
    (no planted concept, no client skew), and each caption carries a per-pair nuisance word the image does not show.

    Nothing separates the forget pairs from held-out pairs but training: a model ranks a pair's own caption above
    its same-shape twins with other nuisance words only by having memorised that pair, so the forget/retain gap is
    memorisation, and a matched held-out split (``heldout``, drawn like the forget pairs, never trained on) gives the
    level a model that never saw the forget pairs reaches on them — the non-member target of EASE's adaptive
    strength. Captions are *less* unique than Flickr30K's (96 visible combinations × 4 words: ≈ 3 pairs share one
    caption at the benchmark's size) because the tiny model memorised nothing finer. The ``"membership"`` scenario
    deletes every pair of the first ``forget_fraction`` of each client's data subjects.
    """
    if n_clients < 1:
        raise ValueError("the membership regime needs at least one client")
    n_forget_subjects = max(1, round(forget_fraction * MEMBERSHIP_SUBJECTS))
    clients = []
    for k in range(n_clients):
        rng = np.random.default_rng([seed, 17, k])
        attrs = [_membership_attrs(rng) for _ in range(pairs_per_client)]
        subjects = [f"c{k}-s{int(j)}" for j in rng.integers(0, MEMBERSHIP_SUBJECTS, pairs_per_client)]
        clients.append(generate_pairs(attrs, rng, id_prefix=f"c{k}", subjects=subjects))
    rng = np.random.default_rng([seed, 19])
    test = generate_pairs([_membership_attrs(rng) for _ in range(n_test)], rng, id_prefix="test")
    n_forget = sum(sum(1 for s in c.subjects if int(s.rsplit("-s", 1)[1]) < n_forget_subjects) for c in clients)
    rng = np.random.default_rng([seed, 23])
    n_held = n_forget if n_heldout is None else n_heldout
    heldout = generate_pairs([_membership_attrs(rng) for _ in range(n_held)], rng, id_prefix="held")
    scenarios = {
        "membership": {
            "subjects": [f"c{k}-s{j}" for k in range(n_clients) for j in range(n_forget_subjects)],
            "forget_fraction": forget_fraction,
            "heldout": n_held,
        }
    }
    return SyntheticFederation(clients=clients, test=test, scenarios=scenarios, seed=seed, heldout=heldout)


# ------------------------------------------------------------------------------------------------ Karpathy layout


@dataclass
class KarpathyCaptions:
    """The Flickr30K/COCO Karpathy-split layout, read but not decoded: one row per (image, sentence)."""

    image_paths: list[Path]
    captions: list[str]
    ids: list[str]
    image_index: list[int]  # which image (0..n_images-1) each caption belongs to


def load_karpathy_split(
    json_path: str | Path,
    image_root: str | Path,
    split: str = "test",
    max_images: int | None = None,
    captions_per_image: int | None = None,
) -> KarpathyCaptions:
    """Read a ``dataset_flickr30k.json``/``dataset_coco.json``-style file.

    Layout: ``{"images": [{"filename", "split", "sentences": [{"raw"}...], optional "filepath", "imgid",
    "sentids"}]}``; COCO's entries carry a ``filepath`` (e.g. ``val2014``) below ``image_root``. Karpathy's COCO
    ``restval`` images count as ``train``.
    """
    payload = json.loads(Path(json_path).read_text())
    root = Path(image_root)
    paths: list[Path] = []
    captions: list[str] = []
    ids: list[str] = []
    image_index: list[int] = []
    for entry in payload["images"]:
        entry_split = "train" if entry.get("split") == "restval" else entry.get("split")
        if entry_split != split:
            continue
        if max_images is not None and len(paths) >= max_images:
            break
        path = root / entry.get("filepath", "") / entry["filename"]
        image_no = len(paths)
        paths.append(path)
        sentences = entry["sentences"][:captions_per_image] if captions_per_image else entry["sentences"]
        sentids = entry.get("sentids") or list(range(len(entry["sentences"])))
        for j, sentence in enumerate(sentences):
            raw = sentence.get("raw") or " ".join(sentence.get("tokens", []))
            captions.append(raw.strip())
            ids.append(f"{entry.get('imgid', image_no)}-{sentids[j] if j < len(sentids) else j}")
            image_index.append(image_no)
    return KarpathyCaptions(image_paths=paths, captions=captions, ids=ids, image_index=image_index)


def karpathy_to_dataset(
    data: KarpathyCaptions,
    preprocess: Callable[[Any], torch.Tensor],
    root: Path | None = None,
    digest: Any = None,
) -> CaptionDataset:
    """Decode the images with ``preprocess`` (e.g. open_clip's eval transform) into one row per caption.

    Each image is decoded once and repeated for each of its captions (Flickr30K/COCO have five), the pair layout
    the federation and the retrieval metrics use. With ``root`` (resolved), each path is resolved again here and
    must still lie under it — the registration's check, made again where the file is read (a link swapped in since
    cannot lead out) — and the bytes read once are the bytes decoded and, into ``digest`` (a hashlib object), hashed.
    """
    import hashlib
    import io

    from PIL import Image

    decoded = []
    for path in data.image_paths:
        if root is not None:
            resolved = path.resolve(strict=True)
            if not resolved.is_relative_to(root):
                raise ValueError(f"image {path.name!r} leads out of image_root")
            raw = resolved.read_bytes()
            if digest is not None:
                digest.update(str(resolved.relative_to(root)).encode() + b"\0" + hashlib.sha256(raw).digest())
            source: Any = io.BytesIO(raw)
        else:
            source = path
        with Image.open(source) as im:
            decoded.append(preprocess(im.convert("RGB")))
    images = torch.stack(decoded) if decoded else torch.empty(0)
    rows = images[torch.tensor(data.image_index, dtype=torch.long)] if decoded else images
    return CaptionDataset(images=rows, captions=list(data.captions), ids=list(data.ids))


def simple_preprocess(
    image_size: int, mean: float = IMAGE_MEAN, std: float = IMAGE_STD
) -> Callable[[Any], torch.Tensor]:
    """A PIL → tensor transform (resize, scale, normalise) for models without open_clip's transforms."""

    def _apply(img: Any) -> torch.Tensor:
        img = img.resize((image_size, image_size))
        arr = np.asarray(img, dtype=np.float32) / 255.0
        return (torch.from_numpy(arr).permute(2, 0, 1) - mean) / std

    return _apply


def read_client_assignment(path: str | Path) -> dict[str, str]:
    """Image → client of a real federation: a JSON object ``{"<image>": "<client>"}`` or a CSV with the header
    ``image,client``; ``<image>`` is a Karpathy entry's ``imgid`` or its ``filename``."""
    text = Path(path).read_text()
    if Path(path).suffix.lower() == ".json":
        return {str(k): str(v) for k, v in json.loads(text).items()}
    import csv
    import io

    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows or not {"image", "client"} <= set(rows[0]):
        raise ValueError("a client assignment CSV needs the header image,client")
    return {r["image"].strip(): r["client"].strip() for r in rows}


def load_caption_federation(
    json_path: str | Path,
    image_root: str | Path,
    assignment: dict[str, str],
    preprocess: Callable[[Any], torch.Tensor],
    train_split: str = "train",
    test_split: str = "test",
    captions_per_image: int | None = None,
    max_test_images: int | None = None,
) -> tuple[SyntheticFederation, list[str]]:
    """A real federation from a Karpathy-layout caption file, its image folder and an image → client assignment
    (issue 11 item 6, the data side): each client holds the pairs (one per caption) of its assigned training images,
    every pair's data subject is its image (a samples deletion of one image's pairs); the test split is the shared
    held-out set. Training images with no client are left out. Returns the federation (no planted scenarios) and the
    client names, sorted."""
    train = load_karpathy_split(json_path, image_root, train_split, captions_per_image=captions_per_image)
    test = load_karpathy_split(json_path, image_root, test_split, max_images=max_test_images)
    payload = json.loads(Path(json_path).read_text())
    keys: dict[Path, set[str]] = {}
    for entry in payload["images"]:
        path = Path(image_root) / entry.get("filepath", "") / entry["filename"]
        keys[path] = {str(entry.get("imgid", "")), entry["filename"]}
    owner = [next((assignment[k] for k in keys.get(p, ()) if k in assignment), None) for p in train.image_paths]
    names = sorted({o for o in owner if o is not None})
    if not names:
        raise ValueError("no training image is assigned to a client")
    import hashlib

    root, digest = Path(image_root).resolve(), hashlib.sha256()
    full = karpathy_to_dataset(train, preprocess, root, digest)
    subjects = [train.image_paths[i].name for i in train.image_index]
    full = CaptionDataset(full.images, full.captions, full.ids, subjects=subjects)
    clients = [full.subset([r for r, i in enumerate(train.image_index) if owner[i] == name]) for name in names]
    test_set = karpathy_to_dataset(test, preprocess, root, digest)
    federation = SyntheticFederation(clients=clients, test=test_set, scenarios={}, seed=0)
    federation.source_sha256 = digest.hexdigest()
    return federation, names


def file_sha256(path: str | Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def federation_from_spec(
    spec: dict[str, Any], preprocess: Callable[[Any], torch.Tensor] | None = None
) -> tuple[SyntheticFederation, list[str]]:
    """A registered model's client data from its ``data`` spec (app.registry.schemas): ``kind: "synthetic"`` — the
    seeded generator, clients ``c0..`` —, or ``kind: "karpathy"`` — a caption file, its image folder and an
    image → client assignment, decoded with the backbone's ``preprocess``, clients named by the assignment (sorted).
    Returns the federation and the client names (the service's client ids, in the federation's order)."""
    kind = spec.get("kind", "synthetic")
    if kind == "synthetic":
        fed = make_synthetic_federation(**{k: v for k, v in spec.items() if k != "kind"})
        return fed, [f"c{k}" for k in range(len(fed.clients))]
    if kind != "karpathy":
        raise ValueError(f"unknown data kind {kind!r}")
    if preprocess is None:
        raise ValueError("a caption-file federation needs the backbone's image transform")
    return load_caption_federation(
        spec["captions_path"],
        spec["image_root"],
        read_client_assignment(spec["assignment_path"]),
        preprocess,
        train_split=spec.get("train_split", "train"),
        test_split=spec.get("test_split", "test"),
        captions_per_image=spec.get("captions_per_image"),
        max_test_images=spec.get("max_test_images"),
    )


def export_karpathy(
    federation: SyntheticFederation,
    folder: str | Path,
    client_names: Sequence[str] | None = None,
    image_size: int | None = None,
) -> dict[str, Path]:
    """Write a federation in the layout :func:`load_caption_federation` reads: one PNG per pair under
    ``folder/images`` (de-normalised, resized to ``image_size`` if given), a Karpathy JSON (clients' pairs in the
    ``train`` split, test pairs in ``test``; one sentence per image) and ``assignment.csv`` (image → client). For
    tests and for the scale benchmark when no real data is mounted: the real-data path on generated data."""
    from PIL import Image

    root = Path(folder)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    names = list(client_names) if client_names is not None else [f"c{k}" for k in range(len(federation.clients))]
    entries: list[dict[str, Any]] = []
    rows = ["image,client"]

    def write(data: CaptionDataset, split: str, client: str | None) -> None:
        pixels = (data.images * IMAGE_STD + IMAGE_MEAN).clamp(0, 1).mul(255).round().to(torch.uint8)
        for i in range(len(data)):
            imgid = len(entries)
            filename = f"{imgid:06d}.png"
            img = Image.fromarray(pixels[i].permute(1, 2, 0).numpy())
            if image_size is not None:
                img = img.resize((image_size, image_size), Image.Resampling.BICUBIC)
            img.save(images / filename)
            entries.append(
                {"imgid": imgid, "filename": filename, "split": split, "sentences": [{"raw": data.captions[i]}]}
            )
            if client is not None:
                rows.append(f"{imgid},{client}")

    for name, data in zip(names, federation.clients, strict=True):
        write(data, "train", name)
    write(federation.test, "test", None)
    captions = root / "captions.json"
    captions.write_text(json.dumps({"images": entries}))
    assignment = root / "assignment.csv"
    assignment.write_text("\n".join(rows) + "\n")
    return {"captions_path": captions, "image_root": images, "assignment_path": assignment}
