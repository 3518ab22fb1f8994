package simhost

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/loopdisk"
)

// newDisks makes the loop disks under Dir, each backing file sized from its
// claim's request, and returns the simulator's disk hook for them.
func (h *Host) newDisks() (kubevirtsim.DiskHook, error) {
	disks, err := loopdisk.New(loopdisk.Options{
		BackingDir: filepath.Join(h.o.Dir, "backing"),
		ByIDRoot:   filepath.Join(h.o.Dir, "by-id"),
		Size: func(ctx context.Context, claim string) (int64, error) {
			pvc, err := h.Kube.CoreV1().PersistentVolumeClaims(h.Namespace).Get(ctx, claim, metav1.GetOptions{})
			if err != nil {
				return 0, err
			}
			q := pvc.Spec.Resources.Requests[corev1.ResourceStorage]
			return q.Value(), nil
		},
	})
	if err != nil {
		return nil, err
	}
	h.Disks = disks
	if h.o.HardUnplug {
		return hardUnplug{disks}, nil
	}
	return disks, nil
}

// growDisks plays Longhorn's online expansion below the simulator: once a
// host PVC's capacity grew (the simulator answers the driver's expansion),
// its backing file grows and every loop device on it sees the new size, as
// the guest's disk does when Longhorn expands an attached volume. A disk not
// plugged yet gets the claim's size when it is plugged.
func (h *Host) growDisks(ctx context.Context) error {
	f := informers.NewSharedInformerFactoryWithOptions(h.Kube, 0, informers.WithNamespace(h.Namespace))
	inf := f.Core().V1().PersistentVolumeClaims().Informer()
	grow := func(obj any) {
		pvc, ok := obj.(*corev1.PersistentVolumeClaim)
		if !ok {
			return
		}
		want := pvc.Status.Capacity[corev1.ResourceStorage]
		st, err := os.Stat(h.Disks.BackingFile(pvc.Name))
		if err != nil || want.Value() <= st.Size() {
			return
		}
		if err := h.Disks.Grow(ctx, pvc.Name, want.Value()); err != nil {
			klog.FromContext(ctx).Error(err, "growing the disk of an expanded host PVC", "pvc", klog.KRef(h.Namespace, pvc.Name), "bytes", want.Value())
		}
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    grow,
		UpdateFunc: func(_, obj any) { grow(obj) },
	}); err != nil {
		return err
	}
	f.Start(ctx.Done())
	for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return fmt.Errorf("%v cache not synced", typ)
		}
	}
	return nil
}

// hardUnplug is the loop-device disk hook with one change that keeps a run
// honest: an unplugged disk stops answering at once, as a disk removed from
// a VM does. A plain loop device detached while the guest still has it
// mounted (a staging mount whose NodeUnstageVolume never came) stays fully
// usable until the last unmount, so the stale filesystem would write its
// cached state over the data another node wrote since; with a real hot
// unplug those writes fail. So before the device is detached its size limit
// drops to one sector: every later read or write of the filesystem fails
// with an I/O error and nothing reaches the backing file.
type hardUnplug struct{ *loopdisk.LoopDisks }

func (d hardUnplug) Unplug(ctx context.Context, vm, volume string) error {
	if dev, ok := d.Device(vm, volume); ok {
		if err := cutIO(dev); err != nil {
			klog.FromContext(ctx).Error(err, "cannot cut the unplugged disk's I/O", "vm", vm, "volume", volume, "device", dev)
		}
	}
	return d.LoopDisks.Unplug(ctx, vm, volume)
}

func cutIO(dev string) error {
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	info, err := unix.IoctlLoopGetStatus64(int(f.Fd()))
	if err != nil {
		return fmt.Errorf("LOOP_GET_STATUS64 %s: %w", dev, err)
	}
	info.Sizelimit = 512
	if err := unix.IoctlLoopSetStatus64(int(f.Fd()), info); err != nil {
		return fmt.Errorf("LOOP_SET_STATUS64 %s: %w", dev, err)
	}
	return nil
}
