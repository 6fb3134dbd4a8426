"""DistillationSFTTrainer's entropy and mean_token_accuracy under DDP (two processes, gloo on the CPU), against
SFTTrainer's on the same student, data and steps (learning rate 0: both see one student throughout). Three rows over
two processes, one per batch: each dataloader's last batch holds a row accelerate repeats on the second process, which
SFTTrainer's gather_for_metrics leaves out of its sums; so must ours, which gathers once per log."""

import copy
import os

import pytest
import torch
import torch.multiprocessing as mp

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_trainers_ddp import WORLD, free_port  # noqa: E402

from test_trl import guessing_student, make_sft_trainer, tiny_model, two_word_dataset, word_tokenizer  # noqa: E402

METRICS = ("entropy", "mean_token_accuracy", "eval_entropy", "eval_mean_token_accuracy")


def logged_metrics(rank, port, folder):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    dataset = two_word_dataset(lengths=(3, 6, 1))  # the repeated row's tokens differ from the rest's
    logged = {}
    for name in ("ours", "sft"):
        if name == "ours":
            trainer = make_sft_trainer(os.path.join(folder, "out"), guessing_student(), tiny_model("llama", vocab=144,
                                       seed=1), train_dataset=dataset, eval_dataset=dataset, max_steps=4,
                                       per_device_train_batch_size=1, per_device_eval_batch_size=1, learning_rate=0.0,
                                       ddp_backend="gloo")
        else:
            trainer = trl.SFTTrainer(model=guessing_student(), args=copy.deepcopy(trainer.args), train_dataset=dataset,
                                     eval_dataset=dataset, processing_class=word_tokenizer())
        trainer.train()
        trainer.evaluate()
        logged[name] = [{key: entry[key] for key in METRICS if key in entry} for entry in trainer.state.log_history]
    if rank == 0:
        torch.save(logged, os.path.join(folder, "logged.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def test_the_metrics_under_ddp_are_sfttrainers(tmp_path):
    mp.spawn(logged_metrics, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    logged = torch.load(tmp_path / "logged.pt")
    assert [sorted(entry) for entry in logged["ours"]] == [sorted(entry) for entry in logged["sft"]]
    assert sum(len(entry) for entry in logged["sft"]) >= 8
    for ours, sft in zip(logged["ours"], logged["sft"]):
        for key, value in sft.items():
            assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (key, logged)
