"""Per-run certificates and keys for the e2e cluster, made with the openssl command line: a CA,
the API server's serving certificate, one client certificate per identity (the Node authorizer
and RBAC decide by CN and O), and the service-account signing key."""

from __future__ import annotations

import os
import subprocess
from typing import NamedTuple


class Identity(NamedTuple):
    cert: str
    key: str


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


class Pki:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.ca = Identity(self._path("ca.crt"), self._path("ca.key"))
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            self.ca.key,
            "-out",
            self.ca.cert,
            "-days",
            "2",
            "-subj",
            "/CN=hyperlight-e2e-ca",
        )
        self.service_account_key = self._path("sa.key")
        self.service_account_pub = self._path("sa.pub")
        _openssl("genrsa", "-out", self.service_account_key, "2048")
        _openssl("rsa", "-in", self.service_account_key, "-pubout", "-out", self.service_account_pub)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def issue(self, name: str, subject: str, server_names: tuple[str, ...] = ()) -> Identity:
        """A certificate for `subject` ("/CN=…/O=…") signed by the CA; server_names become the
        subjectAltNames of a serving certificate."""
        identity = Identity(self._path(f"{name}.crt"), self._path(f"{name}.key"))
        csr = self._path(f"{name}.csr")
        _openssl(
            "req",
            "-new",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            identity.key,
            "-out",
            csr,
            "-subj",
            subject,
        )
        extensions = self._path(f"{name}.ext")
        with open(extensions, "w") as f:
            if server_names:
                f.write("subjectAltName=" + ",".join(server_names) + "\nextendedKeyUsage=serverAuth,clientAuth\n")
            else:
                f.write("extendedKeyUsage=clientAuth\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            self.ca.cert,
            "-CAkey",
            self.ca.key,
            "-CAcreateserial",
            "-out",
            identity.cert,
            "-days",
            "2",
            "-extfile",
            extensions,
        )
        return identity

    def kubeconfig(self, name: str, server: str, identity: Identity) -> str:
        path = self._path(f"{name}.kubeconfig")
        with open(path, "w") as f:
            f.write(f"""apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: {server}
    certificate-authority: {self.ca.cert}
users:
- name: {name}
  user:
    client-certificate: {identity.cert}
    client-key: {identity.key}
contexts:
- name: e2e
  context:
    cluster: e2e
    user: {name}
current-context: e2e
""")
        return path
