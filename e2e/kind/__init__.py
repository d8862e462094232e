"""The kind tier (kind.sh, cluster configs) and its GPU tests, for machines where Docker runs
privileged containers and pulls images; the tests of e2e/cluster run there too."""
