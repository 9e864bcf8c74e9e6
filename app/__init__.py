"""cuckoo-guard's HTTP service: filter management API and the guarded records resource."""
