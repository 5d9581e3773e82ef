"""Progressive resolution: schedule parsing, and a real DeepSpeed engine switched from 16 px to 32 px mid-training
with weights, Adam moments and step carried over and the position embeddings interpolated."""

import os

import pytest
import torch

from pretrain.config import progressive
from pretrain.weights.formats import resize_pos_embed


def test_resolution_at_follows_the_schedule():
    schedule = ((0, 16), (100, 24), (250, 32))
    assert [progressive.resolution_at(schedule, s, 32) for s in (0, 99, 100, 249, 250, 10_000)] == [
        16,
        16,
        24,
        24,
        32,
        32,
    ]
    assert progressive.resolution_at((), 5, 224) == 224


@pytest.mark.parametrize(
    ("schedule", "match"),
    [
        ([[10, 16], [20, 32]], "start at step 0"),
        ([[0, 16], [0, 32]], "increase strictly"),
        ([[0, 18], [20, 32]], "multiple of the patch stride 4"),
        ([[0, 16], [20, 24]], "data.image_size=32"),
        ([[0, 16, 3]], "pair"),
    ],
)
def test_check_schedule_rejects_bad_schedules(schedule, match):
    with pytest.raises(ValueError, match=match):
        progressive.check_schedule(schedule, image_size=32, stride=4)


def test_check_schedule_accepts_a_good_one():
    assert progressive.check_schedule([[0, 16], [100, 32]], 32, 4) == ((0, 16), (100, 32))


def test_recipe_option_is_parsed_validated_and_applied_per_step():
    from pretrain.config.train_config import TrainConfig, load_config

    config = load_config("local_demo", ["data.resolution_schedule=[[0, 16], [100, 32]]"])
    assert config.data.resolution_schedule == ((0, 16), (100, 32))
    config.validate(2, check_paths=False)
    assert TrainConfig.from_dict(__import__("yaml").safe_load(config.to_yaml())) == config  # config.yaml round trip
    assert progressive.config_at(config, 99).data.image_size == 16
    assert progressive.config_at(config, 100) is config  # the final resolution is the recipe's own image_size
    with pytest.raises(ValueError, match="data.image_size=24"):
        load_config("local_demo", ["data.resolution_schedule=[[0, 16], [100, 24]]"]).validate(2, check_paths=False)
    with pytest.raises(ValueError, match="zero_stage"):
        load_config("local_demo", ["data.resolution_schedule=[[0, 16], [100, 32]]", "deepspeed.zero_stage=3"]).validate(
            2, check_paths=False
        )


@pytest.fixture(scope="module")
def process_group():
    """One gloo rank for DeepSpeed; torn down so no group leaks into other test modules."""
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    created = not dist.is_initialized()
    if created:
        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
        saved = {k: os.environ.get(k) for k in [*env, "MASTER_PORT"]}
        os.environ.update(env)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    yield
    if created:
        from pretrain.distributed import finish_distributed

        finish_distributed()  # DeepSpeed's destroy: its cached groups must not outlive the torch group either
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _engine(task_name: str, image_size: int, zero_stage: int):
    import deepspeed

    from pretrain.config.ds_config import engine_config
    from pretrain.config.optim import build_optimizer
    from pretrain.config.train_config import load_config
    from pretrain.model.tasks import build_task
    from pretrain.model.vit import build_model

    config = load_config(
        "local_demo",
        [
            f"task.name={task_name}",
            "task.options={}",  # the task's own defaults, not local_demo's classification_mpp options
            "loss.label_smoothing=0.0",
            f"deepspeed.zero_stage={zero_stage}",
            "data.global_batch_size=8",
            "data.micro_batch_size=8",
        ],
    )
    torch.manual_seed(0)
    model = build_model("vit_tiny_debug", image_size=image_size, num_classes=10)
    task = build_task(config, model)
    engine, *_ = deepspeed.initialize(
        model=task, optimizer=build_optimizer(task, config.optim), config=engine_config(config, 1, "fp32")
    )
    return engine, model


def _train(engine, size: int, steps: int, gen: torch.Generator) -> list[float]:
    losses = []
    for _ in range(steps):
        images = torch.rand(8, 3, size, size, generator=gen) * 2 - 1
        labels = torch.randint(0, 10, (8,), generator=gen)
        loss, _ = engine(images, labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("task_name", "zero_stage"), [("mpp", 2), ("classification", 0)])
def test_switch_resolution_carries_weights_and_adam_state(process_group, task_name, zero_stage):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    gen = torch.Generator().manual_seed(0)
    engine, model = _engine(task_name, 16, zero_stage)
    before = _train(engine, 16, 3, gen)
    old = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    probe = "model.blocks.0.mlp.fc1.weight" if "model.blocks.0.mlp.fc1.weight" in old else next(iter(old))

    def moment(eng, name, key):
        progressive._link_states(eng)  # DeepSpeed links only the first param group's fragments itself
        p = dict(eng.module.named_parameters())[name]
        value = safe_get_full_optimizer_state(p, key)
        if value is None:  # ZeRO off: the torch optimizer holds the state of the parameter itself
            inner = getattr(eng.optimizer, "optimizer", eng.optimizer)
            value = inner.state[p][key]
        return value.detach().clone()

    old_m = moment(engine, probe, "exp_avg")
    old_pos_v = moment(engine, "model.pos_embed", "exp_avg_sq")
    assert model.pos_embed.shape == (1, 1 + 16, 64)

    engine, model = progressive.switch_resolution(engine, model, lambda: _engine(task_name, 32, zero_stage))

    assert model.pos_embed.shape == (1, 1 + 64, 64)  # 4x4 → 8x8 grid of 4-px patches
    assert model.config.image_size == 32
    new = dict(engine.module.named_parameters())
    torch.testing.assert_close(new["model.pos_embed"].detach(), resize_pos_embed(old["model.pos_embed"], (8, 8)))
    torch.testing.assert_close(new[probe].detach(), old[probe])
    fp32 = safe_get_full_fp32_param(new[probe])
    if fp32 is not None:  # the optimizer's master copy was carried too, not only the module's working copy
        torch.testing.assert_close(fp32, old[probe])
    torch.testing.assert_close(moment(engine, probe, "exp_avg"), old_m)
    torch.testing.assert_close(moment(engine, "model.pos_embed", "exp_avg_sq"), resize_pos_embed(old_pos_v, (8, 8)))
    if task_name == "mpp":
        assert int(engine.module.draws) == 3  # the corruption counter survives the rebuild

    after = _train(engine, 32, 3, gen)
    assert all(torch.isfinite(torch.tensor(before + after)))
    engine.destroy()
