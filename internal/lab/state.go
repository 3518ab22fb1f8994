package lab

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/harvester-csi/harvester-csi-driver/internal/lab/invariants"
	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
	"github.com/harvester-csi/harvester-csi-driver/internal/simguest"
	"github.com/harvester-csi/harvester-csi-driver/internal/simhost"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
)

// mount is one line of the mount table.
type mount struct{ point, source, dev string }

func readMounts() ([]mount, error) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	var out []mount
	for _, l := range strings.Split(string(data), "\n") {
		f := strings.Fields(l)
		sep := -1
		for i, x := range f {
			if x == "-" {
				sep = i
				break
			}
		}
		if len(f) < 5 || sep < 0 || sep+2 >= len(f) {
			continue
		}
		out = append(out, mount{point: unescape(f[4]), source: f[sep+2], dev: f[2]})
	}
	return out, nil
}

func unescape(s string) string { return strings.ReplaceAll(s, `\040`, " ") }

// nodeMounts are the staging and publish mounts under a node's kubelet root.
func nodeMounts(mounts []mount, n *simguest.Node) (staged, published []mount) {
	csiRoot := filepath.Join(n.Root, "plugins", "kubernetes.io", "csi") + "/"
	pods := filepath.Join(n.Root, "pods") + "/"
	for _, m := range mounts {
		switch {
		case strings.HasPrefix(m.point, csiRoot) && strings.HasSuffix(m.point, "/globalmount"):
			staged = append(staged, m)
		case strings.HasPrefix(m.point, pods) && strings.Contains(m.point, "/volumes/kubernetes.io~csi/") && strings.HasSuffix(m.point, "/mount"):
			published = append(published, m)
		}
	}
	return staged, published
}

// stagedVolume reads the volume handle the kubelet wrote next to a staging
// directory.
func stagedVolume(globalmount string) string {
	data, err := os.ReadFile(filepath.Join(filepath.Dir(globalmount), "vol_data.json"))
	if err != nil {
		return ""
	}
	var v struct {
		VolumeHandle string `json:"volumeHandle"`
	}
	_ = json.Unmarshal(data, &v)
	return v.VolumeHandle
}

func publishedVolume(point string) string {
	i := strings.Index(point, "/volumes/kubernetes.io~csi/")
	rest := point[i+len("/volumes/kubernetes.io~csi/"):]
	return strings.TrimSuffix(rest, "/mount")
}

// devNumber is a block device's "major:minor", as the mount table shows it.
func devNumber(path string) string {
	var st unix.Stat_t
	if unix.Stat(path, &st) != nil {
		return ""
	}
	return fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
}

// staged lists every staging mount on the guest nodes, and whether its device
// is still the disk plugged into that node's VM.
func staged(h *simhost.Host, nodes []*simguest.Node) ([]invariants.Staged, error) {
	mounts, err := readMounts()
	if err != nil {
		return nil, err
	}
	var out []invariants.Staged
	for _, n := range nodes {
		st, _ := nodeMounts(mounts, n)
		for _, m := range st {
			vol := stagedVolume(m.point)
			dev, ok := h.Disks.Device(h.Namespace+"/"+n.Name, vol)
			out = append(out, invariants.Staged{Node: n.Name, Volume: vol, Attached: ok && devNumber(dev) == m.dev})
		}
	}
	return out, nil
}

// vmiVolumes is every VMI's volumeStatus (hotplug entries).
func vmiVolumes(ctx context.Context, h *simhost.Host, nodes []string) map[string]invariants.VMIVolumes {
	out := map[string]invariants.VMIVolumes{}
	for _, n := range nodes {
		_, vmi := h.VM(ctx, n)
		vols := invariants.VMIVolumes{}
		if vmi != nil {
			for _, vs := range vmi.Status.VolumeStatus {
				if vs.HotplugVolume != nil {
					vols[vs.Name] = string(vs.Phase)
				}
			}
		}
		out[n] = vols
	}
	return out
}

// finalState gathers every view of the attachments.
func finalState(ctx context.Context, kube kubernetes.Interface, h *simhost.Host, nodes []*simguest.Node, backing string) (invariants.Final, error) {
	var f invariants.Final
	vas, err := kube.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	if err != nil {
		return f, err
	}
	for _, va := range vas.Items {
		vol := ""
		if va.Spec.Source.PersistentVolumeName != nil {
			vol = *va.Spec.Source.PersistentVolumeName
		}
		f.VolumeAttachments = append(f.VolumeAttachments, invariants.Pair{Node: va.Spec.NodeName, Volume: vol})
	}
	f.VolumeRequests = map[string]int{}
	mounts, err := readMounts()
	if err != nil {
		return f, err
	}
	for _, n := range nodes {
		vm, vmi := h.VM(ctx, n.Name)
		if vm != nil {
			if t := vm.Spec.Template; t != nil {
				for _, v := range t.Spec.Volumes {
					hot := (v.PersistentVolumeClaim != nil && v.PersistentVolumeClaim.Hotpluggable) || (v.DataVolume != nil && v.DataVolume.Hotpluggable)
					if hot {
						f.VMSpec = append(f.VMSpec, invariants.Pair{Node: n.Name, Volume: v.Name})
					}
				}
			}
			f.VolumeRequests[n.Name] = len(vm.Status.VolumeRequests)
		}
		if vmi != nil {
			for _, vs := range vmi.Status.VolumeStatus {
				if vs.HotplugVolume != nil {
					f.VMIStatus = append(f.VMIStatus, invariants.Pair{Node: n.Name, Volume: vs.Name})
				}
			}
		}
		ents, _ := os.ReadDir(h.ByIDDir(n.Name))
		for _, e := range ents {
			if vol, ok := strings.CutPrefix(e.Name(), loopdisk.LinkPrefix); ok {
				f.ByID = append(f.ByID, invariants.Pair{Node: n.Name, Volume: vol})
			}
		}
		st, pub := nodeMounts(mounts, n)
		for _, m := range st {
			f.Staged = append(f.Staged, invariants.Pair{Node: n.Name, Volume: stagedVolume(m.point)})
		}
		for _, m := range pub {
			f.Published = append(f.Published, invariants.Pair{Node: n.Name, Volume: publishedVolume(m.point)})
		}
	}
	f.LoopDevices = loopDevicesOn(backing)
	return f, nil
}

// loopDevicesOn lists the loop devices whose backing file is under dir.
func loopDevicesOn(dir string) []string {
	var out []string
	ents, _ := os.ReadDir("/sys/block")
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "loop") {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/sys/block", e.Name(), "loop", "backing_file"))
		if err != nil {
			continue
		}
		if strings.HasPrefix(strings.TrimSpace(string(b)), dir+"/") {
			out = append(out, "/dev/"+e.Name())
		}
	}
	return out
}

// hostVolumes reads every Longhorn volume with the host nodes each view
// puts it on. The three lists are not one snapshot: they are read in the
// order in which a node enters the views (engine, then satisfied ticket,
// then attached host VolumeAttachment) and leaves them backwards (host
// VolumeAttachment deleted, ticket removed, engine stopped). A node a later
// read still shows was in the earlier views too at their read: two nodes
// then, a real double attachment. A node a later read shows newly had
// entered the earlier views already, unless a Longhorn stage (attach,
// detach, migration engine start: seconds) lies between the reads
// (milliseconds). A paused API server stops Longhorn's stand-in with it.
func hostVolumes(ctx context.Context, h *simhost.Host) ([]invariants.HostVolume, error) {
	vols, err := h.Longhorn.Volumes(ctx)
	if err != nil {
		return nil, err
	}
	lvas, err := h.Longhorn.VolumeAttachments(ctx)
	if err != nil {
		return nil, err
	}
	hvas, err := h.Kube.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, err
	}
	return hostVolumeViews(vols, lvas, hvas.Items), nil
}

// hostVolumeViews puts Longhorn's volumes, its VolumeAttachments and the
// host's VolumeAttachments of driver.longhorn.io together by volume (a
// Longhorn VolumeAttachment and the host PV are named as the volume).
func hostVolumeViews(vols []*simlonghorn.Volume, lvas []*simlonghorn.VolumeAttachment, hvas []storagev1.VolumeAttachment) []invariants.HostVolume {
	byName := map[string]*invariants.HostVolume{}
	out := make([]invariants.HostVolume, 0, len(vols))
	for _, v := range vols {
		hv := invariants.HostVolume{
			Name:       v.Name,
			Migratable: v.Spec.Migratable && v.Spec.AccessMode == simlonghorn.AccessModeReadWriteMany,
			Migrating:  v.Spec.MigrationNodeID != "" || v.Status.CurrentMigrationNodeID != "",
		}
		for _, n := range []string{v.Status.CurrentNodeID, v.Status.CurrentMigrationNodeID} {
			if n != "" {
				hv.Engines = append(hv.Engines, n)
			}
		}
		out = append(out, hv)
	}
	for i := range out {
		byName[out[i].Name] = &out[i]
	}
	for _, va := range lvas {
		hv := byName[va.Spec.Volume]
		if hv == nil {
			continue
		}
		for id, t := range va.Spec.AttachmentTickets {
			if t != nil && va.Satisfied(id) {
				hv.Tickets = append(hv.Tickets, t.NodeID)
			}
		}
	}
	for _, va := range hvas {
		if va.Spec.Attacher != simlonghorn.DriverName || va.Spec.Source.PersistentVolumeName == nil ||
			!va.Status.Attached || va.DeletionTimestamp != nil {
			continue
		}
		if hv := byName[*va.Spec.Source.PersistentVolumeName]; hv != nil {
			hv.HostVAs = append(hv.HostVAs, va.Spec.NodeName)
		}
	}
	return out
}
