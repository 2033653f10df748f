"""Operations on the whole registry (registry/operations/): `reg gc`, `reg fsck`, scrubs,
`reg catalog rebuild`."""
