"""--report_to of train.qlora: the tracker package checked before any heavy work (check_tracker), the tracker runs
started in the output directory (init_trackers) and the run's accuracy heatmaps logged as images (log_heatmaps).
The scalars (train/loss, eval/<task>_accuracy, ...) are logged where they are measured (train.run.loop, train.qlora)."""
from __future__ import annotations

import importlib.util
import os

from train.errors import UserError
from train.recipe.args import Args

TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}
TRACKER_PROJECT = "train.qlora"  # tensorboard: the subdirectory of output_dir; wandb: the project (or WANDB_PROJECT)


def check_tracker(report_to: str) -> None:
    if report_to == "none":
        return
    if not any(importlib.util.find_spec(name) for name in TRACKER_PACKAGES[report_to]):
        raise UserError(f"--report_to {report_to} needs the {report_to} package: pip install {report_to} "
                        f"(or pass --report_to none)")


def init_trackers(accelerator, args: Args) -> None:
    """--report_to: tensorboard under output_dir/train.qlora; wandb's run directory in output_dir (unless
    WANDB_DIR is set), in project WANDB_PROJECT or train.qlora, named after output_dir."""
    config = {k: v for k, v in args.to_dict().items() if isinstance(v, (int, float, str, bool))}
    init_kwargs = {}
    project = TRACKER_PROJECT
    if args.report_to == "wandb":
        project = os.environ.get("WANDB_PROJECT", TRACKER_PROJECT)
        init_kwargs["wandb"] = {"name": os.path.basename(os.path.abspath(args.output_dir))}
        if not os.environ.get("WANDB_DIR"):
            init_kwargs["wandb"]["dir"] = args.output_dir
    accelerator.init_trackers(project, config=config, init_kwargs=init_kwargs)


def log_heatmaps(accelerator, pictures: list[str], step: int) -> None:
    """The accuracy heatmaps among a run's pictures (accuracy_<task>.png, before / after) to the trackers that take
    images, as eval/accuracy_<task> (the loss curve is there already, as scalars)."""
    import numpy as np
    from PIL import Image  # matplotlib's own dependency: there are pictures only where matplotlib is

    for png in pictures:
        name = os.path.splitext(os.path.basename(png))[0]
        if not name.startswith("accuracy_"):
            continue
        with Image.open(png) as picture:
            pixels = np.asarray(picture.convert("RGB"))
        for tracker in accelerator.trackers:
            if tracker.name == "tensorboard":
                tracker.log_images({f"eval/{name}": pixels[None]}, step=step, dataformats="NHWC")
            elif tracker.name == "wandb":
                tracker.log_images({f"eval/{name}": [pixels]}, step=step)
