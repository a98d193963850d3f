"""Throw-away PKI for one local control plane, made with the ``openssl`` command line.

One CA signs the API server's serving certificate (SANs: 127.0.0.1, localhost and the in-cluster
service names) and the admin client certificate (``O=system:masters``); an EC key pair signs service
account tokens. A second CA, the front proxy's (as kubeadm makes), signs the client certificate the API
server's aggregator presents to extension API servers (KEDA's metrics API server: :mod:`devcluster.keda`),
which trust it through the ``requestheader`` settings the API server publishes. Everything is written under
the given folder and removed with it.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
#: The common name of the aggregator's client certificate; the only name ``--requestheader-allowed-names``
#: allows.
FRONT_PROXY_CLIENT_CN = "front-proxy-client"


@dataclass(frozen=True)
class Pki:
    """Paths of the files :func:`build_pki` wrote."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path

    # The front proxy's files sit beside the others (fixed names), so a Pki read back from a folder
    # (``ControlPlane.from_state``) finds them without more fields.
    @property
    def front_proxy_ca_cert(self) -> Path:
        """The CA extension API servers trust for the aggregator's requests (the API server's
        ``--requestheader-client-ca-file``, published to them in ``kube-system``)."""
        return self.ca_cert.parent / "front-proxy-ca.crt"

    @property
    def front_proxy_client_cert(self) -> Path:
        """The aggregator's client certificate (CN :data:`FRONT_PROXY_CLIENT_CN`)."""
        return self.ca_cert.parent / "front-proxy-client.crt"

    @property
    def front_proxy_client_key(self) -> Path:
        return self.ca_cert.parent / "front-proxy-client.key"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _sign(
    name: str, subject: str, extensions: str, days: int, directory: Path, ca_cert: Path, ca_key: Path
) -> None:
    _openssl("req", *_EC, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=directory)
    (directory / f"{name}.ext").write_text(extensions)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", str(ca_cert), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", str(days), "-out", f"{name}.crt", "-extfile", f"{name}.ext",
        cwd=directory,
    )  # fmt: skip


def sign_client_cert(pki: Pki, name: str, subject: str, days: int = 7) -> tuple[Path, Path]:
    """A client certificate ``<name>.crt``/``.key`` signed by ``pki``'s CA, e.g. a kubelet's
    (``/O=system:nodes/CN=system:node:<node>``) or kube-proxy's (``/CN=system:kube-proxy``)."""
    directory = pki.ca_cert.parent
    _sign(
        name,
        subject,
        "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n",
        days,
        directory,
        pki.ca_cert,
        pki.ca_key,
    )
    return directory / f"{name}.crt", directory / f"{name}.key"


def sign_serving_cert(
    pki: Pki, name: str, subject: str, sans: tuple[str, ...], days: int = 7
) -> tuple[Path, Path]:
    """A certificate ``<name>.crt``/``.key`` signed by ``pki``'s CA for a server that is also a client of
    its peer with the same certificate (KEDA's operator and metrics API server speak mutual TLS with one
    pair); ``sans`` as openssl writes them (``IP:127.0.0.1``, ``DNS:svc.ns.svc``)."""
    directory = pki.ca_cert.parent
    _sign(
        name,
        subject,
        f"subjectAltName={','.join(sans)}\nextendedKeyUsage=serverAuth,clientAuth\n"
        "keyUsage=digitalSignature,keyEncipherment\n",
        days,
        directory,
        pki.ca_cert,
        pki.ca_key,
    )
    return directory / f"{name}.crt", directory / f"{name}.key"


def build_pki(directory: Path, days: int = 7, extra_ips: tuple[str, ...] = ()) -> Pki:
    """Create a CA, a serving and an admin client certificate and a service-account key pair.

    ``extra_ips`` join the serving certificate's SANs: the node address a real node's pods reach the API
    server on.
    """
    directory.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", *_EC, "-keyout", "ca.key", "-out", "ca.crt", "-days", str(days),
        "-subj", "/CN=kvfleet-dev-ca", cwd=directory,
    )  # fmt: skip
    ca_cert, ca_key = directory / "ca.crt", directory / "ca.key"
    sans = ",".join(
        [
            "IP:127.0.0.1",
            "IP:10.0.0.1",
            *(f"IP:{ip}" for ip in extra_ips),
            "DNS:localhost",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:kubernetes.default.svc.cluster.local",
        ]
    )
    _sign(
        "apiserver",
        "/CN=kube-apiserver",
        f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n",
        days,
        directory,
        ca_cert,
        ca_key,
    )
    _sign(
        "admin",
        "/O=system:masters/CN=kvfleet-admin",
        "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n",
        days,
        directory,
        ca_cert,
        ca_key,
    )
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", "sa.key", cwd=directory)
    _openssl("ec", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=directory)
    _openssl(
        "req", "-x509", *_EC, "-keyout", "front-proxy-ca.key", "-out", "front-proxy-ca.crt",
        "-days", str(days), "-subj", "/CN=kvfleet-dev-front-proxy-ca", cwd=directory,
    )  # fmt: skip
    _sign(
        "front-proxy-client",
        f"/CN={FRONT_PROXY_CLIENT_CN}",
        "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n",
        days,
        directory,
        directory / "front-proxy-ca.crt",
        directory / "front-proxy-ca.key",
    )
    return Pki(
        ca_cert=ca_cert,
        ca_key=ca_key,
        server_cert=directory / "apiserver.crt",
        server_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
    )
