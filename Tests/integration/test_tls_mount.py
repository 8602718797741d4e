"""Against a real server (UBIQFS_TEST_CLOUD=server|server-scale): a mount syncs with a
`ubiqfs serve --tls-cert --tls-key` over HTTPS, trusting the private CA given at login."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

import conftest
from conftest import CLOUD_MODE
from test_devices_and_content import wait_for

pytestmark = pytest.mark.skipif(
    CLOUD_MODE == "embedded", reason="needs a real server; runs with UBIQFS_TEST_CLOUD=server|server-scale"
)


def test_login_mount_and_sync_over_https(ubiq, tmp_path):
    import ubiqstack

    acct = conftest._cloud_account(ubiq.cloud_key)
    tls = ubiqstack.TlsFiles(tmp_path / "tls")
    srv = ubiqstack.ServerProcess(acct.storage, tmp_path / "serve-tls.log", tls=tls).start()
    try:
        ubiq.run("account", "logout", timeout=180)
        name = f"tls{os.getpid()}{int(time.time())}"
        token = ubiqstack.create_account(acct.storage, name)
        refused = ubiq.run("account", "login", "--server", srv.url, "--token", token, check=False)
        assert refused.returncode != 0 and "--ca-cert" in refused.stderr, refused
        ubiq.run("account", "login", "--server", srv.url, "--token", token, "--ca-cert", tls.ca, "--device", "tls")
        ubiq.account = name
        ubiq.run("mount", ubiq.container, ubiq.mnt, "--upload-delay-ms", "100")
        try:
            (ubiq.docs / "over-tls.txt").write_text("sent over https\n")
            ubiq.sync()
            api = ubiqstack.Api(srv.url, token, ca=tls.ca)
            items = api.all_items(ubiq.container)
            assert "over-tls.txt" in {i["name"] for i in items if not i.get("deleted")}
            # A change made by another client arrives through the HTTPS push channel.
            other = next(i for i in items if i["name"] == "over-tls.txt")
            data = b"from the other side\n"
            digest = hashlib.sha256(data).hexdigest()
            assert api.put(f"/v1/chunks/{digest}", data).status == 201
            rec = dict(other, chunks=[{"hash": digest, "length": len(data)}], size=len(data),
                       mtimeNs=time.time_ns(), deviceID="other")
            r = api.put(f"/v1/containers/{ubiq.container}/items/{other['itemID']}", rec,
                        headers={"If-Match": f'"{other["etag"]}"'})
            assert r.status == 200, r
            wait_for(lambda: (ubiq.docs / "over-tls.txt").read_bytes() == data, what="the server's change")
            # Everything the client keeps under the state folder (which the test made itself):
            # token with its CA, index, caches, is private.
            assert (ubiq.state / "account.json").stat().st_mode & 0o777 == 0o600
            assert list(ubiq.state.rglob("*.sqlite")), list(ubiq.state.rglob("*"))
            for p in ubiq.state.rglob("*"):
                if p.is_socket():
                    continue
                mode = p.stat().st_mode & 0o777
                assert mode == 0o700 if p.is_dir() else mode & 0o077 == 0, (p, oct(mode))
        finally:
            ubiq.run("unmount", ubiq.mnt)
        ubiq.run("account", "logout")
    finally:
        srv.stop()
