// Package sweeper removes staging mounts whose disk has gone away. Kubelet
// can skip NodeUnstageVolume entirely (its reconciler may detach a volume it
// believes unmounted); the disk is then hot-unplugged under a live
// staging mount, which keeps a dead filesystem mounted and, on loop-backed
// test nodes, keeps the device busy. The sweeper finds such mounts, lazily
// unmounts them, and says so in an Event and in the log. NodeStageVolume uses
// the same RemoveStale for its own path when the volume comes back first.
//
// It only ever considers mounts of a block device at this driver's staging
// paths under the kubelet root: paths this process staged, or kubelet
// staging directories whose vol_data.json names this driver. Anything else
// (another driver's mounts, a tmpfs with a forged vol_data.json, paths
// outside the kubelet root) is never a candidate.
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

// EventTypeWarning is the type of the Event about a removed mount, and
// ReasonStaleStagingRemoved its reason.
const (
	EventTypeWarning          = "Warning"
	ReasonStaleStagingRemoved = "StaleStagingMountRemoved"
)

// DefaultKubeletRoot is kubelet's --root-dir default.
const DefaultKubeletRoot = "/var/lib/kubelet"

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
	// KubeletRoot is kubelet's root directory (default DefaultKubeletRoot);
	// only mounts below <KubeletRoot>/plugins/kubernetes.io/csi are swept.
	KubeletRoot string
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
	o Options
	// csiDir is <KubeletRoot>/plugins/kubernetes.io/csi with symlinks in it
	// resolved, as mount points appear in the mount table.
	csiDir  string
	mu      sync.Mutex
	tracked map[string]string // staging path -> volume ID
}

// New returns a Sweeper with defaults applied.
func New(o Options) (*Sweeper, error) {
	if o.Finder == nil || o.Mounter == nil {
		return nil, fmt.Errorf("sweeper needs a Finder and a Mounter")
	}
	if o.KubeletRoot == "" {
		o.KubeletRoot = DefaultKubeletRoot
	}
	if !filepath.IsAbs(o.KubeletRoot) {
		return nil, fmt.Errorf("kubelet root %q is not an absolute path", o.KubeletRoot)
	}
	if o.Interval <= 0 {
		o.Interval = time.Minute
	}
	if o.Confirm <= 0 {
		o.Confirm = time.Second
	}
	root := filepath.Clean(o.KubeletRoot)
	if r, err := filepath.EvalSymlinks(root); err == nil {
		root = r
	}
	return &Sweeper{o: o, csiDir: filepath.Join(root, "plugins", "kubernetes.io", "csi"), tracked: map[string]string{}}, nil
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

// Owner returns the volume whose staging path path is: tracked by this
// process, or a kubelet staging directory of this driver. Only paths under
// the kubelet root qualify.
func (s *Sweeper) Owner(path string) (string, bool) {
	p := mountinfo.Canonical(path)
	if !strings.HasPrefix(p, s.csiDir+"/") {
		return "", false
	}
	s.mu.Lock()
	vol, ok := s.tracked[p]
	s.mu.Unlock()
	if ok {
		return vol, true
	}
	return s.kubeletStaging(p)
}

// Run sweeps every Interval until ctx ends.
func (s *Sweeper) Run(ctx context.Context) {
	logger := klog.FromContext(ctx).WithName("sweeper")
	ctx = klog.NewContext(ctx, logger)
	logger.Info("stale staging sweeper running", "interval", s.o.Interval, "kubeletCSIDir", s.csiDir)
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
		present, _, err := s.o.Finder.Present(mountDevice(c.mount))
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

// sweepOne takes the volume lock so a node operation on the volume never
// races with the removal.
func (s *Sweeper) sweepOne(ctx context.Context, c candidate) (Swept, bool, error) {
	if s.o.TryLock != nil && c.volumeID != "" {
		release, ok := s.o.TryLock(c.volumeID)
		if !ok {
			klog.FromContext(ctx).V(2).Info("volume busy with a node operation; sweeping it later", "volume", c.volumeID, "path", c.mount.MountPoint)
			return Swept{}, false, nil
		}
		defer release()
	}
	return s.RemoveStale(ctx, c.volumeID, c.mount.MountPoint, "")
}

// RemoveStale lazily unmounts, from the top, every mount at path whose block
// device is gone, and reports the removal once (log and Event). It stops at
// the first mount that is not stale: a device still present, a bind of a
// subdirectory, or no block device at all (tmpfs, NFS), which it never
// touches. The caller holds the volume's lock; when names the occasion in
// the message ("before staging it again"), empty for a sweep.
func (s *Sweeper) RemoveStale(ctx context.Context, volumeID, path, when string) (Swept, bool, error) {
	logger := klog.FromContext(ctx).WithValues("volume", volumeID, "path", path)
	var sw Swept
	for i := 0; i < 10; i++ {
		mnt, ok, err := s.o.Mounter.MountAt(path)
		if err != nil {
			return Swept{}, false, err
		}
		if !ok || !blockBacked(mnt) {
			break
		}
		present, reason, err := s.o.Finder.Present(mountDevice(mnt))
		if err != nil {
			return Swept{}, false, err
		}
		if present {
			break
		}
		if err := s.o.Mounter.Detach(ctx, path); err != nil {
			return Swept{}, false, err
		}
		sw = Swept{VolumeID: volumeID, StagingPath: mnt.MountPoint, Device: mnt.Source, Reason: reason}
	}
	if sw.StagingPath == "" {
		return Swept{}, false, nil
	}
	occasion := ""
	if when != "" {
		occasion = " " + when
	}
	msg := fmt.Sprintf("removed stale staging mount %s of volume %s%s: its disk %s is gone (%s) but NodeUnstageVolume was never called",
		sw.StagingPath, sw.VolumeID, occasion, sw.Device, sw.Reason)
	logger.Info("removed stale staging mount; NodeUnstageVolume was never called", "device", sw.Device, "reason", sw.Reason, "when", when)
	if s.o.Recorder != nil {
		s.o.Recorder.Event(ctx, sw.VolumeID, EventTypeWarning, ReasonStaleStagingRemoved, msg)
	}
	s.Forget(sw.StagingPath)
	return sw, true, nil
}

// blockBacked is a filesystem mount (root "/", not a bind of a subdirectory)
// of a block device. Filesystems without one (tmpfs, NFS, overlay) have an
// anonymous device number with major 0.
func blockBacked(m mountinfo.Mount) bool {
	return m.Root == "/" && m.Major != 0 && filepath.IsAbs(m.Source)
}

func mountDevice(m mountinfo.Mount) device.Device {
	return device.Device{Path: m.Source, Major: m.Major, Minor: m.Minor}
}

// candidates are block-backed mounts at staging paths of this driver under
// the kubelet root (see Owner), one per path.
func (s *Sweeper) candidates(mounts []mountinfo.Mount) []candidate {
	byPath := map[string]candidate{}
	for _, m := range mounts {
		if !blockBacked(m) {
			continue
		}
		if vol, ok := s.Owner(m.MountPoint); ok {
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

// kubeletStaging recognises <csiDir>/.../globalmount whose vol_data.json
// kubelet wrote for this driver, and returns the volume handle.
func (s *Sweeper) kubeletStaging(mountPoint string) (string, bool) {
	if s.o.DriverName == "" || filepath.Base(mountPoint) != "globalmount" {
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
