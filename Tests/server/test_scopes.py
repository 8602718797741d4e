"""Token scopes, expiry and rotation (docs/protocol.md, "Tokens"), on both engines: an account
token (from the admin CLI) manages devices; a device token (from `POST /v1/devices`, i.e. from
`ubiqfs account login`) syncs, lists devices, rotates and revokes itself, but gets 403 on minting
tokens or revoking any other; expired and rotated-away tokens get 401."""

from __future__ import annotations

import json
import os
import subprocess
import time

from test_api import C, error, put_file
from ubiqstack import UBIQFS_BIN, Api, run_cli


def _mint(api: Api, name: str, **extra) -> tuple[Api, dict]:
    r = api.post("/v1/devices", {"name": name, **extra})
    assert r.status == 201, r
    return api.with_token(r.json()["token"]), r.json()["device"]


def test_device_token_cannot_mint_or_revoke(api):
    phone, phone_rec = _mint(api, "phone")
    tablet, tablet_rec = _mint(api, "tablet")
    assert phone_rec["scope"] == "device" and tablet_rec["scope"] == "device"
    # The device token syncs and lists devices.
    assert phone.ensure_container(C)["token"] == 2
    assert put_file(phone, "f1", "a.txt", b"from phone").status == 201
    listed = {d["device"]: d for d in phone.get("/v1/devices").json()["devices"]}
    assert listed["setup"]["scope"] == "account"
    assert listed["phone"]["scope"] == "device"
    # It can neither mint a token nor revoke another device (not even the account token).
    error(phone.post("/v1/devices", {"name": "thief"}), 403, "insufficient_scope")
    error(phone.delete(f"/v1/devices/{tablet_rec['id']}"), 403, "insufficient_scope")
    error(phone.delete(f"/v1/devices/{listed['setup']['id']}"), 403, "insufficient_scope")
    assert tablet.get("/v1/account").status == 200
    assert api.get("/v1/account").status == 200
    assert "thief" not in {d["device"] for d in api.get("/v1/devices").json()["devices"]}
    # The account credential revokes it; a device may still revoke itself (sign out).
    assert api.delete(f"/v1/devices/{tablet_rec['id']}").status == 200
    error(tablet.get("/v1/account"), 401, "unauthorized")
    assert phone.delete(f"/v1/devices/{phone_rec['id']}").status == 200
    error(phone.get("/v1/account"), 401, "unauthorized")


def test_admin_cli_scopes(storage, server, api):
    default = run_cli("server", "token", "create", api.account, *storage.args(), env_extra=storage.env()).stdout.strip()
    dev = run_cli(
        "server", "token", "create", api.account, "--device", "kiosk", "--scope", "device", *storage.args(),
        env_extra=storage.env()).stdout.strip()
    assert api.with_token(default).post("/v1/devices", {"name": "via-account"}).status == 201
    error(api.with_token(dev).post("/v1/devices", {"name": "via-device"}), 403, "insufficient_scope")
    listed = {d["device"]: d for d in api.get("/v1/devices").json()["devices"]}
    assert listed["kiosk"]["scope"] == "device"
    assert listed["via-account"]["scope"] == "device"
    bad = run_cli("server", "token", "create", api.account, "--scope", "root", *storage.args(),
                  env_extra=storage.env(), check=False)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1, bad


def test_expired_token_gets_401(storage, server, api):
    temp, rec = _mint(api, "temp", expiresIn=2)
    assert rec["expiresAt"] - time.time() <= 3
    forever, rec2 = _mint(api, "forever")
    assert rec2.get("expiresAt") is None
    assert temp.get("/v1/account").status == 200
    cli = run_cli("server", "token", "create", api.account, "--device", "short", "--expires", "2s", *storage.args(),
                  env_extra=storage.env()).stdout.strip()
    short = api.with_token(cli)
    assert short.get("/v1/account").status == 200
    time.sleep(3.2)
    error(temp.get("/v1/account"), 401, "token_expired")
    error(short.get("/v1/usage"), 401, "token_expired")
    assert forever.get("/v1/account").status == 200
    for bad in (0, -5, "soon", 10 * 366 * 86400 * 100):
        error(api.post("/v1/devices", {"name": "x", "expiresIn": bad}), 400,
              "bad_json" if isinstance(bad, str) else "invalid")


def test_rotated_away_token_gets_401(server, api):
    phone, rec = _mint(api, "phone", expiresIn=3600)
    r = phone.post("/v1/devices/current/rotate")
    assert r.status == 200, r
    body = r.json()
    assert body["token"].startswith("ubq_")
    assert body["device"]["id"] == rec["id"]
    assert body["device"]["scope"] == "device"
    assert body["device"]["expiresAt"] == rec["expiresAt"]  # rotation never extends a lifetime
    error(phone.get("/v1/account"), 401, "unauthorized")
    new = phone.with_token(body["token"])
    assert new.get("/v1/account").json()["tokenID"] == rec["id"]
    error(new.post("/v1/devices", {"name": "x"}), 403, "insufficient_scope")
    setup_id = api.get("/v1/account").json()["tokenID"]
    error(new.post(f"/v1/devices/{setup_id}/rotate"), 403, "insufficient_scope")
    # Its own id works like `current`; signing out still reaches DELETE /v1/devices/current.
    r = new.post(f"/v1/devices/{rec['id']}/rotate")
    assert r.status == 200, r
    error(new.get("/v1/account"), 401, "unauthorized")
    newer = new.with_token(r.json()["token"])
    assert newer.delete("/v1/devices/current").status == 200
    error(newer.get("/v1/account"), 401, "unauthorized")
    # The account token can rotate itself too.
    r = api.post("/v1/devices/current/rotate")
    assert r.status == 200, r
    error(api.get("/v1/account"), 401, "unauthorized")
    assert api.with_token(r.json()["token"]).get("/v1/account").status == 200


def test_login_with_a_device_token_is_refused(tmp_path, server, api):
    phone, _ = _mint(api, "phone")
    env = {**os.environ, "UBIQFS_STATE_DIR": str(tmp_path / "state")}
    cp = subprocess.run(
        [UBIQFS_BIN, "account", "login", "--server", server.url, "--token", phone.token, "--device", "x"],
        capture_output=True, text=True, env=env, timeout=60)
    assert cp.returncode != 0, cp
    lines = cp.stderr.strip().splitlines()
    assert len(lines) == 1 and "account token" in lines[0], cp.stderr
    assert not (tmp_path / "state" / "account.json").exists()


def test_account_cli_devices_rotate_revoke(tmp_path, server, api):
    """`ubiqfs account devices|rotate|revoke` on a signed-in state folder."""
    env = {**os.environ, "UBIQFS_STATE_DIR": str(tmp_path / "state")}
    env.pop("UBIQFS_TOKEN", None)

    def ubiq(*args):
        return subprocess.run([UBIQFS_BIN, *map(str, args)], capture_output=True, text=True, env=env, timeout=60)

    cp = ubiq("account", "login", "--server", server.url, "--token", api.token, "--device", "cli-dev")
    assert cp.returncode == 0, cp
    cfg_path = tmp_path / "state" / "account.json"
    cfg = json.loads(cfg_path.read_text())
    phone, phone_rec = _mint(api, "phone")
    # Devices: listed with the device token, this one marked.
    cp = ubiq("account", "devices")
    assert cp.returncode == 0, cp
    rows = {line.split("\t")[1]: line.split("\t") for line in cp.stdout.splitlines()[1:]}
    assert rows["cli-dev"][2] == "device" and rows["cli-dev"][4] == "this device", cp.stdout
    assert rows["setup"][2] == "account" and rows["phone"][4] == "live", cp.stdout
    # Rotate: the saved token changes, the old one is refused, the new one works.
    cp = ubiq("account", "rotate")
    assert cp.returncode == 0, cp
    new = json.loads(cfg_path.read_text())
    assert new["token"] != cfg["token"] and new["tokenID"] == cfg["tokenID"]
    error(api.with_token(cfg["token"]).get("/v1/account"), 401, "unauthorized")
    assert api.with_token(new["token"]).get("/v1/account").status == 200
    assert cfg_path.stat().st_mode & 0o777 == 0o600
    # Revoke: needs the account token; the device token alone is refused with one line.
    cp = ubiq("account", "revoke", phone_rec["id"])
    assert cp.returncode != 0 and len(cp.stderr.strip().splitlines()) == 1 and "--token" in cp.stderr, cp
    cp = ubiq("account", "revoke", phone_rec["id"], "--token", new["token"])
    assert cp.returncode != 0 and len(cp.stderr.strip().splitlines()) == 1 and "account token" in cp.stderr, cp
    assert phone.get("/v1/account").status == 200
    cp = ubiq("account", "revoke", phone_rec["id"], "--token", api.token)
    assert cp.returncode == 0, cp
    error(phone.get("/v1/account"), 401, "unauthorized")
