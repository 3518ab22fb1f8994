// Package sweeper removes staging mounts whose disk has gone away. Kubelet
// can skip NodeUnstageVolume entirely (its reconciler may detach a volume it
// believes unmounted, seed 000); the disk is then hot-unplugged under a live
// staging mount, which keeps a dead filesystem mounted and, on loop-backed
// test nodes, keeps the device busy. The sweeper finds such mounts, lazily
// unmounts them, and says so in an Event and in the log.
package sweeper

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/pkg/node/device"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mounter"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/mountinfo"
)

// Event types and the reason the sweeper reports with.
const (
	EventTypeNormal  = "Normal"
	EventTypeWarning = "Warning"
	// ReasonStaleStagingRemoved is the Event reason for a swept mount.
	ReasonStaleStagingRemoved = "StaleStagingMountRemoved"
)

// EventRecorder publishes a Kubernetes Event about a volume; the
// implementation chooses the object (the guest PV named volumeID, or the
// node when the volume is unknown).
type EventRecorder interface {
	Event(ctx context.Context, volumeID, eventType, reason, message string)
}

// Options configures a Sweeper.
type Options struct {
	// DriverName recognises, after a restart, kubelet staging directories of
	// this driver: <dir>/globalmount next to <dir>/vol_data.json naming it.
	DriverName string
	// Interval between sweeps in Run (default 1m).
	Interval time.Duration
	// Confirm is how long a device must stay gone before its mount is
	// swept (default 1s): udev may briefly rewrite by-id links.
	Confirm time.Duration
	Finder  *device.Finder
	Mounter *mounter.Mounter
	// Recorder is optional.
	Recorder EventRecorder
	// TryLock, if set, serialises the sweep of a volume with node operations
	// on it; ok=false skips the volume this round.
	TryLock func(volumeID string) (release func(), ok bool)
}

// Swept describes one removed staging mount.
type Swept struct {
	VolumeID    string
	StagingPath string
	Device      string
	Reason      string
}

// Sweeper finds and removes stale staging mounts.
type Sweeper struct {
	o       Options
	mu      sync.Mutex
	tracked map[string]string // staging path -> volume ID
}

// New returns a Sweeper with defaults applied.
func New(o Options) (*Sweeper, error) {
	if o.Finder == nil || o.Mounter == nil {
		return nil, fmt.Errorf("sweeper needs a Finder and a Mounter")
	}
	if o.Interval <= 0 {
		o.Interval = time.Minute
	}
	if o.Confirm <= 0 {
		o.Confirm = time.Second
	}
	return &Sweeper{o: o, tracked: map[string]string{}}, nil
}

// Track records a staging path this process mounted for volumeID.
func (s *Sweeper) Track(volumeID, stagingPath string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tracked[mountinfo.Canonical(stagingPath)] = volumeID
}

// Forget drops a staging path after NodeUnstageVolume.
func (s *Sweeper) Forget(stagingPath string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.tracked, mountinfo.Canonical(stagingPath))
}

// Run sweeps every Interval until ctx ends.
func (s *Sweeper) Run(ctx context.Context) {
	logger := klog.FromContext(ctx).WithName("sweeper")
	ctx = klog.NewContext(ctx, logger)
	logger.Info("stale staging sweeper running", "interval", s.o.Interval)
	t := time.NewTicker(s.o.Interval)
	defer t.Stop()
	for {
		if _, err := s.Sweep(ctx); err != nil && ctx.Err() == nil {
			logger.Error(err, "sweep failed")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

type candidate struct {
	volumeID string
	mount    mountinfo.Mount
}

// Sweep looks once and removes staging mounts whose device is gone. It never
// unmounts anything whose device is still present.
func (s *Sweeper) Sweep(ctx context.Context) ([]Swept, error) {
	mounts, err := s.o.Mounter.Mounts()
	if err != nil {
		return nil, err
	}
	var gone []candidate
	for _, c := range s.candidates(mounts) {
		dev := device.Device{Path: c.mount.Source, Major: c.mount.Major, Minor: c.mount.Minor}
		present, _, err := s.o.Finder.Present(dev)
		if err != nil {
			klog.FromContext(ctx).Error(err, "cannot tell whether the staging device is present", "volume", c.volumeID, "path", c.mount.MountPoint)
			continue
		}
		if !present {
			gone = append(gone, c)
		}
	}
	if len(gone) == 0 {
		return nil, nil
	}
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(s.o.Confirm):
	}
	var out []Swept
	for _, c := range gone {
		sw, ok, err := s.sweepOne(ctx, c)
		if err != nil {
			klog.FromContext(ctx).Error(err, "removing stale staging mount failed", "volume", c.volumeID, "path", c.mount.MountPoint)
			continue
		}
		if ok {
			out = append(out, sw)
		}
	}
	return out, nil
}

// sweepOne re-checks under the volume lock and unmounts only while the top
// mount at the path is still on a gone device, so a fresh stage that raced
// with the sweep is left alone.
func (s *Sweeper) sweepOne(ctx context.Context, c candidate) (Swept, bool, error) {
	logger := klog.FromContext(ctx).WithValues("volume", c.volumeID, "path", c.mount.MountPoint)
	if s.o.TryLock != nil && c.volumeID != "" {
		release, ok := s.o.TryLock(c.volumeID)
		if !ok {
			logger.V(2).Info("volume busy with a node operation; sweeping it later")
			return Swept{}, false, nil
		}
		defer release()
	}
	var sw Swept
	for i := 0; i < 10; i++ {
		mnt, ok, err := s.o.Mounter.MountAt(c.mount.MountPoint)
		if err != nil {
			return Swept{}, false, err
		}
		if !ok {
			break
		}
		dev := device.Device{Path: mnt.Source, Major: mnt.Major, Minor: mnt.Minor}
		present, reason, err := s.o.Finder.Present(dev)
		if err != nil {
			return Swept{}, false, err
		}
		if present {
			break
		}
		if err := s.o.Mounter.Detach(ctx, c.mount.MountPoint); err != nil {
			return Swept{}, false, err
		}
		sw = Swept{VolumeID: c.volumeID, StagingPath: c.mount.MountPoint, Device: mnt.Source, Reason: reason}
	}
	if sw.StagingPath == "" {
		return Swept{}, false, nil
	}
	msg := fmt.Sprintf("removed stale staging mount %s of volume %s: its disk %s is gone (%s) but NodeUnstageVolume was never called",
		sw.StagingPath, sw.VolumeID, sw.Device, sw.Reason)
	logger.Info("removed stale staging mount; NodeUnstageVolume was never called", "device", sw.Device, "reason", sw.Reason)
	if s.o.Recorder != nil {
		s.o.Recorder.Event(ctx, sw.VolumeID, EventTypeWarning, ReasonStaleStagingRemoved, msg)
	}
	s.Forget(sw.StagingPath)
	return sw, true, nil
}

// candidates are filesystem mounts (root "/", not a bind of a subdirectory)
// at a tracked staging path or at a kubelet staging directory of this
// driver, one per path.
func (s *Sweeper) candidates(mounts []mountinfo.Mount) []candidate {
	s.mu.Lock()
	tracked := make(map[string]string, len(s.tracked))
	for k, v := range s.tracked {
		tracked[k] = v
	}
	s.mu.Unlock()
	byPath := map[string]candidate{}
	for _, m := range mounts {
		if m.Root != "/" {
			continue
		}
		if vol, ok := tracked[m.MountPoint]; ok {
			byPath[m.MountPoint] = candidate{volumeID: vol, mount: m}
			continue
		}
		if vol, ok := s.kubeletStaging(m.MountPoint); ok {
			byPath[m.MountPoint] = candidate{volumeID: vol, mount: m}
		}
	}
	out := make([]candidate, 0, len(byPath))
	for _, c := range byPath {
		out = append(out, c)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].mount.MountPoint < out[j].mount.MountPoint })
	return out
}

// kubeletStaging recognises <dir>/globalmount whose <dir>/vol_data.json
// kubelet wrote for this driver, and returns the volume handle.
func (s *Sweeper) kubeletStaging(mountPoint string) (string, bool) {
	if s.o.DriverName == "" || filepath.Base(mountPoint) != "globalmount" || !strings.Contains(mountPoint, "kubernetes.io/csi") {
		return "", false
	}
	b, err := os.ReadFile(filepath.Join(filepath.Dir(mountPoint), "vol_data.json"))
	if err != nil {
		return "", false
	}
	var vd struct {
		DriverName   string `json:"driverName"`
		VolumeHandle string `json:"volumeHandle"`
	}
	if json.Unmarshal(b, &vd) != nil || vd.DriverName != s.o.DriverName || vd.VolumeHandle == "" {
		return "", false
	}
	return vd.VolumeHandle, true
}
