package driver

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/device"
)

const (
	// maxDeviceWait bounds the wait for a disk when the call has no
	// deadline: kubelet's own timeout for NodeStage and NodePublish.
	maxDeviceWait = 2 * time.Minute
	// maxAnswerMargin is the most a disk wait leaves free before the
	// caller's deadline, to answer and release the volume's lock while the
	// caller still listens.
	maxAnswerMargin = 2 * time.Second
)

// waitDisk waits for the volume's disk as long as the call allows (harvester
// 10217): the publish that plugged it has returned, but the guest's SCSI
// scan and udev link it moments later, or the publish is still in flight.
// Waiting in the call mounts the disk as soon as it appears; a disk that
// does not appear in time is Unavailable, naming the volume, answered a
// little before the caller's deadline so that the answer is ours (not the
// caller's own DeadlineExceeded) and the volume's lock is free for kubelet's
// retry, whose backoff stays short.
func (s *NodeService) waitDisk(ctx context.Context, id string) (device.Device, error) {
	limit := maxDeviceWait
	if s.opts.DeviceWait > 0 {
		limit = s.opts.DeviceWait
	}
	if deadline, ok := ctx.Deadline(); ok {
		left := time.Until(deadline)
		limit = min(limit, left-min(maxAnswerMargin, left/4))
	}
	waitCtx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	dev, err := s.finder.Wait(waitCtx, id)
	var nf *device.NotFoundError
	if errors.As(err, &nf) && nf.StillArriving() {
		return device.Device{}, status.Errorf(codes.Unavailable, "volume %s: its disk has not appeared yet (retry): %v", id, err)
	}
	return dev, err
}
