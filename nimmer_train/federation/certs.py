"""TLS for a federation (``nimmer federation certs``): the operator's certificate authority and
the SuperLink's server certificate, made with ``cryptography``.

The CA's certificate (``ca.crt``) is what every contributor and the ``flwr`` CLI verify the
SuperLink with; its key (``ca.key``) signs server certificates and stays with the operator (keep
it offline). An existing CA in the folder is reused, so renewing the server certificate does not
change what contributors hold. Private keys are written 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from nimmer_train.artifacts import write_secret
from nimmer_train.errors import NimmerError

CA_CERT, CA_KEY, SERVER_CERT, SERVER_KEY = "ca.crt", "ca.key", "server.crt", "server.key"


@dataclass(frozen=True)
class Certificates:
    ca: Path
    ca_key: Path
    server: Path
    server_key: Path
    ca_reused: bool


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _alt_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write_key(path: Path, key: rsa.RSAPrivateKey) -> None:
    """A fresh 0600 file renamed over ``path`` (never an existing one reopened: a reader holding
    an old key file open, or a link planted at ``path``, must not see the new key)."""
    pem, traditional = serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL
    write_secret(path, key.private_bytes(pem, traditional, serialization.NoEncryption()), overwrite=True)


def _ca(folder: Path, days: int, now: datetime.datetime) -> tuple[x509.Certificate, rsa.RSAPrivateKey, bool]:
    """The folder's CA, or a new one."""
    cert_path, key_path = folder / CA_CERT, folder / CA_KEY
    if cert_path.exists() != key_path.exists():
        raise NimmerError(
            f"{folder} holds one of {CA_CERT} and {CA_KEY} but not the other; move it away or restore both"
        )
    if cert_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise NimmerError(f"{key_path} is not an RSA private key")
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        _check_reused(cert, key, cert_path, key_path, now)
        return cert, key, True
    key = rsa.generate_private_key(public_exponent=65537, key_size=3072)
    name = _name("nimmer federation CA")
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key_path, key)
    return cert, key, False


def _check_reused(
    cert: x509.Certificate, key: rsa.RSAPrivateKey, cert_path: Path, key_path: Path, now: datetime.datetime
) -> None:
    """A reused CA must be one: its key, a CA certificate, still valid, its key private."""
    if cert.public_key() != key.public_key():
        raise NimmerError(
            f"{key_path} is not the key of {cert_path}; restore the matching pair or move both away"
        )
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise NimmerError(f"{cert_path} is not a CA certificate; move it and {key_path} away")
    if cert.not_valid_after_utc <= now:
        raise NimmerError(
            f"{cert_path} expired on {cert.not_valid_after_utc:%Y-%m-%d}; move it and {key_path} away "
            "to make a new CA (and give contributors the new ca.crt)"
        )
    mode = os.stat(key_path).st_mode & 0o077
    if mode:
        raise NimmerError(
            f"{key_path} is readable by others (mode {os.stat(key_path).st_mode & 0o777:o}): "
            f"`chmod 600 {key_path}`, or make a new CA if it may have been copied"
        )


def make_certificates(folder: Path, hosts: list[str], days: int = 365) -> Certificates:
    """A CA (reused when the folder has one) and a server certificate for ``hosts`` (the names
    and addresses contributors reach the SuperLink by), valid for ``days``."""
    if not hosts:
        raise NimmerError("name at least one --host: the address contributors reach the SuperLink at")
    if days < 1:
        raise NimmerError(f"--days {days}: a certificate must be valid for at least one day")
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca, ca_key, reused = _ca(folder, max(days, 365), now)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(min(now + datetime.timedelta(days=days), ca.not_valid_after_utc))
        .add_extension(x509.SubjectAlternativeName([_alt_name(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    (folder / SERVER_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(folder / SERVER_KEY, key)
    return Certificates(folder / CA_CERT, folder / CA_KEY, folder / SERVER_CERT, folder / SERVER_KEY, reused)
