"""A throwaway certificate authority for TLS tests: a CA, a server and a client certificate.

Made with the ``cryptography`` package (no openssl binary): P-256 keys, one day valid, the
server's certificate names 127.0.0.1 and localhost. ``TestCa.create(dir)`` writes PEM files.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclasses.dataclass(frozen=True)
class TestCa:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    __test__ = False  # not a pytest test class

    @classmethod
    def create(cls, out_dir: Path, name: str = "kvrelay-test-ca") -> TestCa:
        out_dir.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        ca = _builder(ca_name, ca_name, ca_key.public_key()).add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True
        )
        ca_cert = ca.sign(ca_key, hashes.SHA256())
        paths = {"ca_cert": _write_cert(out_dir / "ca.pem", ca_cert)}
        for role, usage in (
            ("server", ExtendedKeyUsageOID.SERVER_AUTH),
            ("client", ExtendedKeyUsageOID.CLIENT_AUTH),
        ):
            key = ec.generate_private_key(ec.SECP256R1())
            subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvrelay-{role}")])
            builder = _builder(subject, ca_name, key.public_key()).add_extension(
                x509.ExtendedKeyUsage([usage]), critical=False
            )
            if role == "server":
                names = [
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.DNSName("localhost"),
                ]
                builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
            paths[f"{role}_cert"] = _write_cert(
                out_dir / f"{role}.pem", builder.sign(ca_key, hashes.SHA256())
            )
            paths[f"{role}_key"] = _write_key(out_dir / f"{role}.key", key)
        return cls(**paths)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    path.write_bytes(pem)
    path.chmod(0o600)
    return path
