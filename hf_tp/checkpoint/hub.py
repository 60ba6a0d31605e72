"""Upload an exported folder to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi


def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False, token: str | None = None) -> str:
    """Create ``repo_id`` if needed and upload ``folder``; returns the commit URL.

    The token comes from ``token``, ``HF_TOKEN`` or ``huggingface-cli login``. Any failure (no
    network, no permission) raises one clear ``RuntimeError``; the local folder is never touched.
    """
    folder = Path(folder)
    if not any((folder / name).is_file() for name in ("config.json", "adapter_config.json")):  # model or adapter
        raise ValueError(f"{folder} is not an exported model folder (no config.json); run hf-tp export first")
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message="Upload model trained with hf_tp",
        )
    except Exception as exc:  # noqa: BLE001 - network, auth and API errors all end the same way
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RuntimeError(
            f"push to the Hub repo '{repo_id}' failed ({type(exc).__name__}: {first}); the export is kept at {folder}"
        ) from None
    return str(getattr(info, "commit_url", info))
