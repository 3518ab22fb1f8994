package kubevirtsim

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	admissionv1 "k8s.io/api/admission/v1"
	admregv1 "k8s.io/api/admissionregistration/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
)

// Names of the simulated admission webhooks, as they appear in denial
// messages ("admission webhook "<name>" denied the request: ..."); KubeVirt's
// are named in v1.7.0 pkg/virt-operator/resource/generate/components/webhooks.go.
const (
	WebhookVMStatus  = "kubevirt-crd-status-validator.kubevirt.io"
	WebhookVM        = "virtualmachine-validator.kubevirt.io"
	WebhookVMIUpdate = "virtualmachineinstances-update-validator.kubevirt.io"
	WebhookHarvester = "validator.harvesterhci.io"
)

const probeAnnotation = "kubevirtsim.io/webhook-probe"

// webhooks are the admission webhooks of virt-api and Harvester, served over
// TLS on 127.0.0.1 and registered as one ValidatingWebhookConfiguration.
type webhooks struct {
	c      *cluster
	faults *Faults
	srv    *webhookServer
}

func newWebhooks(c *cluster, f *Faults) *webhooks { return &webhooks{c: c, faults: f} }

// start serves the webhooks and registers them with the API server.
func (w *webhooks) start(ctx context.Context) error {
	srv, err := w.serve()
	if err != nil {
		return err
	}
	w.srv = srv
	return w.register(ctx)
}

// stop unregisters the webhooks (so the API server does not call a dead
// one) and stops serving.
func (w *webhooks) stop() {
	if w.srv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := w.c.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations().Delete(ctx, w.srv.cfgKey, metav1.DeleteOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		w.c.log.V(1).Info("could not remove webhook configuration", "name", w.srv.cfgKey, "err", err)
	}
	w.srv.close()
}

type webhookServer struct {
	srv    *http.Server
	url    string
	caPEM  []byte
	cfgKey string // name of the ValidatingWebhookConfiguration
}

func (w *webhooks) serve() (*webhookServer, error) {
	caPEM, cert, err := testenv.LoopbackServing("kubevirtsim-webhook")
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/vm-status", admitHandler(w.admitVMStatus))
	mux.HandleFunc("/vm", admitHandler(w.admitVM))
	mux.HandleFunc("/vmi-update", admitHandler(w.admitVMIUpdate))
	mux.HandleFunc("/harvester-vm", admitHandler(w.admitHarvesterVM))
	name := "kubevirtsim"
	if w.c.opts.Namespace != "" {
		name += "-" + w.c.opts.Namespace
	}
	srv := &webhookServer{
		srv:    &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}},
		url:    "https://" + ln.Addr().String(),
		caPEM:  caPEM,
		cfgKey: name,
	}
	w.c.goRun(func() {
		if err := srv.srv.ServeTLS(ln, "", ""); err != nil && !errors.Is(err, http.ErrServerClosed) {
			w.c.log.Error(err, "webhook server stopped")
		}
	})
	return srv, nil
}

func (w *webhookServer) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := w.srv.Shutdown(ctx); err != nil {
		_ = w.srv.Close()
	}
}

// register writes the ValidatingWebhookConfiguration and waits until the
// API server calls it.
func (w *webhooks) register(ctx context.Context) error {
	srv := w.srv
	var nsSel *metav1.LabelSelector
	if w.c.opts.Namespace != "" {
		nsSel = &metav1.LabelSelector{MatchLabels: map[string]string{"kubernetes.io/metadata.name": w.c.opts.Namespace}}
	}
	hook := func(name, path string, ops []admregv1.OperationType, resource string) admregv1.ValidatingWebhook {
		return admregv1.ValidatingWebhook{
			Name:                    name,
			ClientConfig:            admregv1.WebhookClientConfig{URL: ptr.To(srv.url + path), CABundle: srv.caPEM},
			Rules:                   []admregv1.RuleWithOperations{{Operations: ops, Rule: admregv1.Rule{APIGroups: []string{"kubevirt.io"}, APIVersions: []string{"v1"}, Resources: []string{resource}, Scope: ptr.To(admregv1.NamespacedScope)}}},
			FailurePolicy:           ptr.To(admregv1.Fail),
			SideEffects:             ptr.To(admregv1.SideEffectClassNone),
			AdmissionReviewVersions: []string{"v1"},
			TimeoutSeconds:          ptr.To[int32](10),
			NamespaceSelector:       nsSel,
		}
	}
	cfg := &admregv1.ValidatingWebhookConfiguration{
		ObjectMeta: metav1.ObjectMeta{Name: srv.cfgKey},
		Webhooks: []admregv1.ValidatingWebhook{
			hook(WebhookVMStatus, "/vm-status", []admregv1.OperationType{admregv1.Update}, "virtualmachines/status"),
			hook(WebhookVM, "/vm", []admregv1.OperationType{admregv1.Create, admregv1.Update}, "virtualmachines"),
			hook(WebhookVMIUpdate, "/vmi-update", []admregv1.OperationType{admregv1.Update}, "virtualmachineinstances"),
			hook(WebhookHarvester, "/harvester-vm", []admregv1.OperationType{admregv1.Update}, "virtualmachines"),
		},
	}
	api := w.c.kube.AdmissionregistrationV1().ValidatingWebhookConfigurations()
	cur, err := api.Get(ctx, cfg.Name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		_, err = api.Create(ctx, cfg, metav1.CreateOptions{})
	case err == nil:
		cur.Webhooks = cfg.Webhooks
		_, err = api.Update(ctx, cur, metav1.UpdateOptions{})
	}
	if err != nil {
		return fmt.Errorf("kubevirtsim: register webhooks: %w", err)
	}
	// Probe until the API server has picked the configuration up: a dry-run
	// create that the VM webhook denies on sight.
	probeNS := w.c.opts.Namespace
	if probeNS == "" {
		probeNS = "default"
	}
	if err := w.c.ensureNamespace(ctx, probeNS); err != nil {
		return err
	}
	probe := &kubevirtv1.VirtualMachine{
		TypeMeta:   metav1.TypeMeta{APIVersion: kubevirtv1.GroupVersion.String(), Kind: "VirtualMachine"},
		ObjectMeta: metav1.ObjectMeta{Name: "kubevirtsim-webhook-probe", Namespace: probeNS, Annotations: map[string]string{probeAnnotation: srv.url}},
		Spec:       kubevirtv1.VirtualMachineSpec{Template: &kubevirtv1.VirtualMachineInstanceTemplateSpec{}},
	}
	return wait.PollUntilContextTimeout(ctx, 50*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		err := w.c.kv.rc.Post().Namespace(probeNS).Resource(resVMs).Param("dryRun", metav1.DryRunAll).Body(probe).Do(ctx).Error()
		if err != nil && apierrors.IsInvalid(err) {
			if st, ok := err.(*apierrors.StatusError); ok && st.ErrStatus.Message != "" && strings.Contains(st.ErrStatus.Message, "kubevirtsim webhook probe") {
				return true, nil
			}
		}
		return false, nil
	})
}

// admitHandler serves f as an admission webhook; the causes' messages are
// joined as v1.7.0 pkg/util/webhooks/webhooks.go:54 ToAdmissionResponse does.
func admitHandler(f func(*admissionv1.AdmissionRequest) []metav1.StatusCause) http.HandlerFunc {
	return testenv.AdmissionHandler(func(req *admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse {
		causes := f(req)
		if len(causes) == 0 {
			return &admissionv1.AdmissionResponse{Allowed: true}
		}
		msgs := make([]string, len(causes))
		for i, c := range causes {
			msgs[i] = c.Message
		}
		return &admissionv1.AdmissionResponse{Result: &metav1.Status{
			Status:  metav1.StatusFailure,
			Message: strings.Join(msgs, ", "),
			Reason:  metav1.StatusReasonInvalid,
			Code:    http.StatusUnprocessableEntity,
			Details: &metav1.StatusDetails{Causes: causes},
		}}
	})
}

func decodeVM(raw []byte) (*kubevirtv1.VirtualMachine, error) {
	vm := &kubevirtv1.VirtualMachine{}
	if len(raw) == 0 {
		return vm, nil
	}
	return vm, json.Unmarshal(raw, vm)
}

func invalid(field, format string, args ...any) []metav1.StatusCause {
	return []metav1.StatusCause{{Type: metav1.CauseTypeFieldValueInvalid, Message: fmt.Sprintf(format, args...), Field: field}}
}

// admitVMStatus is virt-api's VM status validator (v1.7.0
// pkg/virt-api/webhooks/validating-webhook/admitters/vms-admitter.go
// validateVolumeRequests): it validates the queued volume requests against
// each other, the template, the running VMI, the bus rules of the version
// and migrations.
func (w *webhooks) admitVMStatus(req *admissionv1.AdmissionRequest) []metav1.StatusCause {
	vm, err := decodeVM(req.Object.Raw)
	if err != nil {
		return invalid("", "%v", err)
	}
	if len(vm.Status.VolumeRequests) == 0 {
		return nil
	}
	const field = "Status.volumeRequests"
	vmVols := map[string]kubevirtv1.Volume{}
	for _, v := range vm.Spec.Template.Spec.Volumes {
		vmVols[v.Name] = v
	}
	var vmi *kubevirtv1.VirtualMachineInstance
	if vm.Status.Ready {
		if obj, ok, _ := w.c.vmiInf.GetStore().GetByKey(vm.Namespace + "/" + vm.Name); ok {
			if v := obj.(*kubevirtv1.VirtualMachineInstance); v.DeletionTimestamp == nil {
				vmi = v
			}
		}
	}
	vmiVols := map[string]kubevirtv1.Volume{}
	if vmi != nil {
		for _, v := range vmi.Spec.Volumes {
			vmiVols[v.Name] = v
		}
	}
	adds, removes := map[string]bool{}, map[string]bool{}
	for _, r := range vm.Status.VolumeRequests {
		switch {
		case r.AddVolumeOptions != nil && r.RemoveVolumeOptions != nil:
			return invalid(field, "VolumeRequests require either addVolumeOptions or removeVolumeOptions to be set, not both")
		case r.AddVolumeOptions != nil:
			name := r.AddVolumeOptions.Name
			if adds[name] {
				return invalid(field, "AddVolume request for [%s] aleady exists", name)
			}
			if c := w.validateHotplugDisk(r.AddVolumeOptions.Disk, name, "AddVolume request", field); c != nil {
				return c
			}
			nv := kubevirtv1.Volume{Name: name}
			if src := r.AddVolumeOptions.VolumeSource; src != nil {
				if src.PersistentVolumeClaim != nil {
					nv.PersistentVolumeClaim = src.PersistentVolumeClaim
				} else if src.DataVolume != nil {
					nv.DataVolume = src.DataVolume
				}
			}
			if v, ok := vmVols[name]; ok && !equality.Semantic.DeepEqual(nv, v) {
				return invalid(field, "AddVolume request for [%s] conflicts with an existing volume of the same name on the vmi template.", name)
			}
			if v, ok := vmiVols[name]; ok && !equality.Semantic.DeepEqual(nv, v) {
				return invalid(field, "AddVolume request for [%s] conflicts with an existing volume of the same name on currently running vmi", name)
			}
			adds[name] = true
		case r.RemoveVolumeOptions != nil:
			name := r.RemoveVolumeOptions.Name
			if removes[name] {
				return invalid(field, "RemoveVolume request for [%s] aleady exists", name)
			}
			removes[name] = true
		default:
			return invalid(field, "VolumeRequests require one of either addVolumeOptions or removeVolumeOptions to be set")
		}
	}
	if vmi != nil && isMigrating(vmi) {
		return []metav1.StatusCause{{Type: metav1.CauseTypeFieldValueNotSupported, Message: "Cannot handle volume requests while VMI migration is in progress", Field: "spec"}}
	}
	return nil
}

func isMigrating(vmi *kubevirtv1.VirtualMachineInstance) bool {
	ms := vmi.Status.MigrationState
	if ms == nil || ms.StartTimestamp == nil {
		return false
	}
	now := time.Now()
	if ms.StartTimestamp.After(now) {
		return false
	}
	return ms.EndTimestamp == nil || ms.EndTimestamp.After(now)
}

// validateHotplugDisk applies the hotplug bus rules of the version (v1.5.3
// vms-admitter.go:455-485: scsi only; v1.6.3 vms-admitter.go:462,
// v1.7.0 pkg/storage/admitters/storagehotplug.go:67: scsi or virtio, LUNs
// scsi).
func (w *webhooks) validateHotplugDisk(disk *kubevirtv1.Disk, name, prefix, field string) []metav1.StatusCause {
	if disk == nil {
		return invalid(field, "%s for [%s] requires the disk field to be set.", prefix, name)
	}
	if disk.Disk == nil && disk.LUN == nil {
		return invalid(field, "%s for [%s] requires diskDevice of type 'disk' or 'lun' to be used.", prefix, name)
	}
	bus := diskBus(disk)
	if w.c.feat.v15Messages {
		if bus != kubevirtv1.DiskBusSCSI {
			return invalid(field, "%s for [%s] requires disk bus to be 'scsi'. [%s] is not permitted", prefix, name, bus)
		}
		return nil
	}
	if disk.Disk != nil {
		if bus != kubevirtv1.DiskBusSCSI && bus != kubevirtv1.DiskBusVirtio {
			return invalid(field, "%s for disk [%s] requires bus to be 'scsi' or 'virtio'. [%s] is not permitted.", prefix, name, bus)
		}
		return nil
	}
	if bus != kubevirtv1.DiskBusSCSI {
		return invalid(field, "%s for LUN [%s] requires bus to be 'scsi'. [%s] is not permitted.", prefix, name, bus)
	}
	return nil
}

func diskBus(d *kubevirtv1.Disk) kubevirtv1.DiskBus {
	switch {
	case d.Disk != nil:
		return d.Disk.Bus
	case d.LUN != nil:
		return d.LUN.Bus
	case d.CDRom != nil:
		return d.CDRom.Bus
	}
	return ""
}

// admitVM is the VM validator's snapshot rule (and the startup probe).
func (w *webhooks) admitVM(req *admissionv1.AdmissionRequest) []metav1.StatusCause {
	vm, err := decodeVM(req.Object.Raw)
	if err != nil {
		return invalid("", "%v", err)
	}
	if req.Operation == admissionv1.Create && vm.Annotations[probeAnnotation] == w.srv.url {
		return invalid("", "kubevirtsim webhook probe")
	}
	if req.Operation != admissionv1.Update || vm.Status.SnapshotInProgress == nil {
		return nil
	}
	old, err := decodeVM(req.OldObject.Raw)
	if err != nil {
		return []metav1.StatusCause{{Type: metav1.CauseTypeUnexpectedServerResponse, Message: "Could not fetch old vm"}}
	}
	if !sameVolumes(old.Spec.Template, vm.Spec.Template) {
		return []metav1.StatusCause{{Type: metav1.CauseTypeFieldValueNotSupported,
			Message: fmt.Sprintf("Cannot update vm disks or volumes until snapshot %q completes", *vm.Status.SnapshotInProgress), Field: "spec"}}
	}
	return nil
}

func sameVolumes(a, b *kubevirtv1.VirtualMachineInstanceTemplateSpec) bool {
	var va, vb []kubevirtv1.Volume
	if a != nil {
		va = a.Spec.Volumes
	}
	if b != nil {
		vb = b.Spec.Volumes
	}
	if len(va) != len(vb) {
		return false
	}
	for i := range va {
		if !equality.Semantic.DeepEqual(va[i], vb[i]) {
			return false
		}
	}
	return true
}

// admitHarvesterVM denies VM updates that add a volume the test marked with
// DenyVolume, like Harvester's VM validator does for a volume in use by
// another VM.
func (w *webhooks) admitHarvesterVM(req *admissionv1.AdmissionRequest) []metav1.StatusCause {
	denied := w.faults.deniedVolumes()
	if len(denied) == 0 {
		return nil
	}
	vm, err := decodeVM(req.Object.Raw)
	if err != nil || vm.Spec.Template == nil {
		return nil
	}
	old, _ := decodeVM(req.OldObject.Raw)
	had := map[string]bool{}
	if old.Spec.Template != nil {
		for _, v := range old.Spec.Template.Spec.Volumes {
			had[v.Name] = true
		}
	}
	for _, v := range vm.Spec.Template.Spec.Volumes {
		if had[v.Name] {
			continue
		}
		for _, key := range []string{v.Name, volumeClaim(v)} {
			if msg, ok := denied[key]; ok && key != "" {
				if msg == "" {
					msg = fmt.Sprintf("the volume %s is refused by an admission policy", volumeClaim(v))
				}
				return invalid("spec.template.spec.volumes", "%s", msg)
			}
		}
	}
	return nil
}
