package driver

import (
	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mounter"
)

// checkCapabilities applies checkCapability to each of a non-empty list.
func checkCapabilities(caps []*csi.VolumeCapability) error {
	if len(caps) == 0 {
		return status.Error(codes.InvalidArgument, "volume capabilities are required")
	}
	for _, c := range caps {
		if err := checkCapability(c); err != nil {
			return err
		}
	}
	return nil
}

// checkCapability accepts what one VM's hot-plugged disk can serve (a block
// device or a filesystem the node can create and grow, on one node at a
// time) and what a Harvester NetworkFilesystem can serve (a filesystem
// mounted over NFS by many nodes: MULTI_NODE_MULTI_WRITER, mount only).
// Controller and node use the same rules, so a volume created is one the
// node can stage; the controller also refuses multi-node volumes when the
// host has no NetworkFilesystems (rwxAvailable).
func checkCapability(c *csi.VolumeCapability) error {
	if c == nil {
		return status.Error(codes.InvalidArgument, "volume capability is required")
	}
	switch mode := c.GetAccessMode().GetMode(); mode {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
	case csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER:
		if c.GetBlock() != nil {
			return status.Error(codes.InvalidArgument, "access mode MULTI_NODE_MULTI_WRITER is served over NFS, as a filesystem only: block ReadWriteMany volumes are not supported")
		}
	case csi.VolumeCapability_AccessMode_UNKNOWN:
		return status.Error(codes.InvalidArgument, "volume capability access mode is required")
	default:
		return status.Errorf(codes.InvalidArgument, "access mode %s is not supported: this driver serves single-node (ReadWriteOnce) volumes and MULTI_NODE_MULTI_WRITER (ReadWriteMany) filesystems", mode)
	}
	switch {
	case c.GetBlock() != nil:
	case c.GetMount() != nil:
		if fs := c.GetMount().GetFsType(); !mounter.SupportedFSType(fs) {
			return status.Errorf(codes.InvalidArgument, "filesystem type %q is not supported (ext4, ext3, xfs)", fs)
		}
	default:
		return status.Error(codes.InvalidArgument, "volume capability must be block or mount")
	}
	return nil
}

func readOnlyMode(c *csi.VolumeCapability) bool {
	return c.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY
}

// multiNode reports a ReadWriteMany (NFS) capability.
func multiNode(c *csi.VolumeCapability) bool {
	return c.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
}

// anyMultiNode reports whether any capability of a list is ReadWriteMany.
func anyMultiNode(caps []*csi.VolumeCapability) bool {
	for _, c := range caps {
		if multiNode(c) {
			return true
		}
	}
	return false
}
