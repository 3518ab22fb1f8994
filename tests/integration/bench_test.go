package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	kvbackend "github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// BenchmarkPublishBurst publishes N volumes to one VM at once, through the
// driver's queue and through an unserialized one-call-per-volume baseline
// (what upstream does), and reports KubeVirt writes, conflicts and the
// simulated time until every volume is Ready (wall time / benchScale).
func BenchmarkPublishBurst(b *testing.B) {
	const benchScale = 0.05 // what docs/benchmarks.md was measured at
	const n = 20
	for _, f := range []flavor{flavors[1], flavors[3]} { // Harvester 1.7 and 1.8
		b.Run(f.name, func(b *testing.B) {
			h := framework.StartHost(b, kubevirtsim.Options{Mode: f.mode, Version: f.version, Scale: benchScale, BindClasslessPVCs: true})
			ctrl := h.StartController(b, framework.ControllerOptions{Backend: f.backendFlag(), Queue: queueConfigAt(benchScale)})
			kv := kubevirt.NewForConfigOrDie(h.Sim.ClientConfig())
			runs := 0 // the benchmark function runs more than once: VM names must not repeat
			for _, mode := range []string{"queued", "baseline"} {
				b.Run(mode, func(b *testing.B) {
					var writes, conflicts int
					var simTime time.Duration
					for range b.N {
						b.StopTimer()
						runs++
						vm := fmt.Sprintf("bench-%s-%d", mode, runs)
						h.CreateVMs(b, vm)
						vols := h.CreateVolumes(b, vm, n)
						h.Sim.ResetStats()
						b.StartTimer()
						start := time.Now()
						ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
						var wg sync.WaitGroup
						for _, vol := range vols {
							wg.Add(1)
							go func() {
								defer wg.Done()
								var err error
								if mode == "queued" {
									err = newAttacher(func() csiClient { return ctrl.Client }).Publish(ctx, publishReq(vm, vol))
								} else {
									err = baselineAttach(ctx, kv, h.Namespace, f.backend, vm, vol)
								}
								if err != nil {
									b.Errorf("%s %s: %v", mode, vol, err)
								}
							}()
						}
						wg.Wait()
						cancel()
						simTime += time.Duration(float64(time.Since(start)) / benchScale)
						st := h.Sim.Stats()
						writes += st.VMSpecWrites + st.VMStatusWrites + st.AddVolume + st.RemoveVolume
						c409, c422 := st.Contended()
						conflicts += c409 + c422
					}
					b.ReportMetric(float64(writes)/float64(b.N), "kubevirt-writes/op")
					b.ReportMetric(float64(conflicts)/float64(b.N), "conflicts/op")
					b.ReportMetric(simTime.Seconds()/float64(b.N), "sim-s-to-ready/op")
				})
			}
		})
	}
}

// baselineAttach is upstream's uncoordinated attach of one volume: a
// resourceVersion-guarded spec patch (declarative) or an addvolume call
// (legacy), retried on conflicts as the attacher would, then a poll until
// the VMI shows the volume Ready.
func baselineAttach(ctx context.Context, kv kubevirt.Interface, ns, backend, vm, vol string) error {
	vms := kv.KubevirtV1().VirtualMachines(ns)
	for {
		var err error
		if backend == kvbackend.BackendDeclarative {
			var cur *kubevirtv1.VirtualMachine
			if cur, err = vms.Get(ctx, vm, metav1.GetOptions{}); err != nil {
				return err
			}
			if kubevirtsim.HasVolume(cur.Spec.Template.Spec.Volumes, vol) {
				break
			}
			patch, _ := json.Marshal([]map[string]any{
				{"op": "test", "path": "/metadata/resourceVersion", "value": cur.ResourceVersion},
				{"op": "add", "path": "/spec/template/spec/volumes/-", "value": map[string]any{"name": vol, "persistentVolumeClaim": map[string]any{"claimName": vol, "hotpluggable": true}}},
				{"op": "add", "path": "/spec/template/spec/domain/devices/disks/-", "value": map[string]any{"name": vol, "disk": map[string]any{"bus": "scsi"}}},
			})
			_, err = vms.Patch(ctx, vm, types.JSONPatchType, patch, metav1.PatchOptions{})
		} else {
			err = vms.AddVolume(ctx, vm, &kubevirtv1.AddVolumeOptions{
				Name: vol,
				Disk: &kubevirtv1.Disk{Name: vol, DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: "scsi"}}},
				VolumeSource: &kubevirtv1.HotplugVolumeSource{PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
					PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: vol}, Hotpluggable: true,
				}},
			})
			if err != nil && strings.Contains(err.Error(), "already exists") {
				err = nil
			}
		}
		if err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(time.Duration(10+rand.IntN(40)) * time.Millisecond):
		}
	}
	return testwait.Poll(ctx, vol+" Ready on "+vm, func() (bool, string, error) {
		vmi, err := kv.KubevirtV1().VirtualMachineInstances(ns).Get(ctx, vm, metav1.GetOptions{})
		if err != nil {
			return false, err.Error(), nil
		}
		e, ok := kubevirtsim.FindVolumeStatus(vmi, vol)
		return ok && e.Phase == kubevirtv1.VolumeReady && e.Target != "", fmt.Sprintf("%+v", e), nil
	})
}
