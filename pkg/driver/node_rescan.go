package driver

import (
	"context"
	"fmt"
	"os"

	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/device"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mounter"
)

// deviceSize asks the kernel to re-read the disk's capacity where it can
// (SCSI rescan) and returns the size the device reports. The guest's SCSI
// layer does not notice on its own that the host grew the disk.
func (s *NodeService) deviceSize(ctx context.Context, dev device.Device) (int64, error) {
	rescan := fmt.Sprintf("%s/dev/block/%d:%d/device/rescan", s.opts.SysfsRoot, dev.Major, dev.Minor)
	if f, err := os.OpenFile(rescan, os.O_WRONLY, 0); err == nil {
		if _, err := f.WriteString("1"); err != nil {
			klog.FromContext(ctx).V(2).Info("disk rescan failed", "device", dev.Path, "err", err)
		}
		_ = f.Close()
	}
	return mounter.DeviceSize(dev.Path)
}
