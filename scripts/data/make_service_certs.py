"""Make a private CA and one certificate per service for mutual TLS between gateway, verifier and drafter.

    python -m scripts.data.make_service_certs DIR [--names gateway,verifier,drafter] [--days 365]

Writes DIR/ca.pem (give it to every service as --tls-ca), and DIR/NAME.pem + DIR/NAME.key for each
name (--tls-cert / --tls-key). Each certificate is valid for server and client use and names
`NAME`, `localhost` and 127.0.0.1, so the compose service names and loopback both verify. Keys are
EC P-256, made by the `openssl` command line tool. The CA key stays in DIR/ca.key: keep it away from
the services. For production, use your own PKI; this is for a first deployment and for the tests.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import subprocess
import tempfile

DEFAULT_NAMES = ("gateway", "verifier", "drafter")


def _openssl(*args: str) -> None:
    if shutil.which("openssl") is None:
        raise RuntimeError("the openssl command line tool is not installed")
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_certs(directory: str | pathlib.Path, names=DEFAULT_NAMES, days: int = 365) -> pathlib.Path:
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ca_key, ca_pem = out / "ca.key", out / "ca.pem"
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(ca_key))
    _openssl(
        "req", "-x509", "-new", "-key", str(ca_key), "-sha256", "-days", str(days),
        "-subj", "/CN=ddtree-serve service CA", "-out", str(ca_pem),
    )  # fmt: skip
    for name in names:
        key, csr, pem = out / f"{name}.key", out / f"{name}.csr", out / f"{name}.pem"
        _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key))
        _openssl("req", "-new", "-key", str(key), "-subj", f"/CN={name}", "-out", str(csr))
        with tempfile.NamedTemporaryFile("w", suffix=".ext", delete=False) as ext:
            ext.write(
                f"subjectAltName=DNS:{name},DNS:localhost,IP:127.0.0.1\n"
                "extendedKeyUsage=serverAuth,clientAuth\n"
                "keyUsage=digitalSignature,keyEncipherment\n"
            )
        try:
            _openssl(
                "x509", "-req", "-in", str(csr), "-CA", str(ca_pem), "-CAkey", str(ca_key), "-CAcreateserial",
                "-days", str(days), "-sha256", "-extfile", ext.name, "-out", str(pem),
            )  # fmt: skip
        finally:
            pathlib.Path(ext.name).unlink()
        csr.unlink()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory")
    p.add_argument("--names", default=",".join(DEFAULT_NAMES), help="comma-separated certificate names")
    p.add_argument("--days", type=int, default=365)
    args = p.parse_args()
    out = make_certs(args.directory, [n for n in args.names.split(",") if n], args.days)
    print(f"wrote {out}/ca.pem and a .pem + .key per name")


if __name__ == "__main__":
    main()
