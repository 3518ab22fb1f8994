package host

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

// The VM and VMI informers hold every VM and VMI of the namespace, and every
// status write of virt-controller or virt-handler sends the whole object
// again. Decoded in full (KubeVirt's VirtualMachineInstanceSpec.UnmarshalJSON
// even decodes each spec twice) that was a quarter of the controller's CPU,
// for a handful of fields. The lean types below are what the informers
// decode instead, for their lists and their watch events alike; the
// kubevirtv1 objects made from them carry only these fields, so every reader
// keeps its types. The fields, and the readers that need them:
//
// metadata (both): name, namespace, uid, resourceVersion, generation,
// creationTimestamp, deletionTimestamp, labels, annotations (without
// kubectl's last-applied copy), ownerReferences; no managedFields. The
// informers' keys, the declarative backend's check that a VM's spec is
// unchanged since its own patch (uid, generation), the guest Node's
// providerID match (uid), a VMI being deleted (GuestStateOf, running).
//
// VMI:
//   - spec.volumes[]: name; persistentVolumeClaim.claimName and
//     .hotpluggable; dataVolume.name. Which claims a VMI holds (the claim
//     index, Holders), inVMISpec, Published and View. And
//     spec.domain.devices.disks[].name, which only the VM's are read for:
//     the VMI's spec is the same KubeVirt type as the VM template's, and
//     keeping the same fields of a type wherever it appears is what lets
//     the test check the readers by type.
//   - status.phase: running, settling, podStarting, wedges, GuestStateOf
//     (IsFinal).
//   - status.conditions[]: type, status, reason. Paused (running) and
//     PausedIOError (deviceMayBeGone).
//   - status.volumeStatus[]: name, phase, reason, message, target,
//     hotplugVolume.attachPodName and .attachPodUID,
//     persistentVolumeClaimInfo.claimName. attached, detached, settling,
//     podStarting, the one-removal-at-a-time rule, wedge marks and messages,
//     the claim index.
//   - status.migrationState: startTimestamp, endTimestamp, sourceNode,
//     targetNode. A live migration holds every hotplug (wedge.go).
//   - status.activePods: the VMI's virt-launcher pods by UID, with their
//     node. A second one that may run is a live migration under way from
//     the moment its target pod exists (migrate.go).
//
// VM:
//   - spec.template (whether it is set) .spec.volumes[] as in the VMI, and
//     .spec.domain.devices.disks[].name: attached, detached, the disk limit,
//     the claim index, View, Lost.
//   - status.volumeRequests[]: addVolumeOptions.name and
//     .volumeSource.persistentVolumeClaim.claimName and .hotpluggable;
//     removeVolumeOptions.name. Legacy hotplug's queued requests.
//   - status.conditions[]: type, status, reason, message. The Failure
//     condition: settling, a webhook's refusal (kubevirt.Refusal), wedges.
//
// Nothing writes an informer object back to the host: the declarative
// backend patches lists it read raw from the API server (or kept from its
// own patch's answer), and the subresource backend's request-list patch is
// built from a live GET. A write built from these objects would erase every
// field they lack. TestLeanTypesKeepEveryFieldTheReadersRead (leanfields_test.go)
// fails when a reader of the informers starts to read a field these types
// drop.

// leanMeta is the metadata kept of a VM or VMI.
type leanMeta struct {
	Name              string                  `json:"name"`
	Namespace         string                  `json:"namespace"`
	UID               types.UID               `json:"uid"`
	ResourceVersion   string                  `json:"resourceVersion"`
	Generation        int64                   `json:"generation"`
	CreationTimestamp metav1.Time             `json:"creationTimestamp"`
	DeletionTimestamp *metav1.Time            `json:"deletionTimestamp"`
	Labels            map[string]string       `json:"labels"`
	Annotations       map[string]string       `json:"annotations"`
	OwnerReferences   []metav1.OwnerReference `json:"ownerReferences"`
}

func (m *leanMeta) fill(o *metav1.ObjectMeta) {
	o.Name, o.Namespace, o.UID, o.ResourceVersion, o.Generation = m.Name, m.Namespace, m.UID, m.ResourceVersion, m.Generation
	o.CreationTimestamp, o.DeletionTimestamp = m.CreationTimestamp, m.DeletionTimestamp
	o.Labels, o.OwnerReferences = m.Labels, m.OwnerReferences
	o.Annotations = m.Annotations
	delete(o.Annotations, lastApplied)
}

type leanClaim struct {
	ClaimName    string `json:"claimName"`
	Hotpluggable bool   `json:"hotpluggable"`
}

func (c *leanClaim) into() *kubevirtv1.PersistentVolumeClaimVolumeSource {
	if c == nil {
		return nil
	}
	return &kubevirtv1.PersistentVolumeClaimVolumeSource{
		PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: c.ClaimName}, Hotpluggable: c.Hotpluggable}
}

type leanDataVolume struct {
	Name string `json:"name"`
}

type leanVolume struct {
	Name                  string          `json:"name"`
	PersistentVolumeClaim *leanClaim      `json:"persistentVolumeClaim"`
	DataVolume            *leanDataVolume `json:"dataVolume"`
}

func leanVolumes(in []leanVolume) []kubevirtv1.Volume {
	if in == nil {
		return nil
	}
	out := make([]kubevirtv1.Volume, len(in))
	for i := range in {
		out[i].Name = in[i].Name
		out[i].PersistentVolumeClaim = in[i].PersistentVolumeClaim.into()
		if d := in[i].DataVolume; d != nil {
			out[i].DataVolume = &kubevirtv1.DataVolumeSource{Name: d.Name}
		}
	}
	return out
}

type leanHotplugStatus struct {
	AttachPodName string    `json:"attachPodName"`
	AttachPodUID  types.UID `json:"attachPodUID"`
}

type leanClaimInfo struct {
	ClaimName string `json:"claimName"`
}

type leanVolumeStatus struct {
	Name                      string                 `json:"name"`
	Target                    string                 `json:"target"`
	Phase                     kubevirtv1.VolumePhase `json:"phase"`
	Reason                    string                 `json:"reason"`
	Message                   string                 `json:"message"`
	PersistentVolumeClaimInfo *leanClaimInfo         `json:"persistentVolumeClaimInfo"`
	HotplugVolume             *leanHotplugStatus     `json:"hotplugVolume"`
}

type leanVMICondition struct {
	Type   kubevirtv1.VirtualMachineInstanceConditionType `json:"type"`
	Status corev1.ConditionStatus                         `json:"status"`
	Reason string                                         `json:"reason"`
}

type leanMigrationState struct {
	StartTimestamp *metav1.Time `json:"startTimestamp"`
	EndTimestamp   *metav1.Time `json:"endTimestamp"`
	TargetNode     string       `json:"targetNode"`
	SourceNode     string       `json:"sourceNode"`
}

type leanVMIStatus struct {
	Phase          kubevirtv1.VirtualMachineInstancePhase `json:"phase"`
	Conditions     []leanVMICondition                     `json:"conditions"`
	VolumeStatus   []leanVolumeStatus                     `json:"volumeStatus"`
	MigrationState *leanMigrationState                    `json:"migrationState"`
	ActivePods     map[types.UID]string                   `json:"activePods"`
}

type leanVMI struct {
	// Kind only tells a Status answer apart; it is not kept.
	Kind     string           `json:"kind"`
	Metadata leanMeta         `json:"metadata"`
	Spec     leanInstanceSpec `json:"spec"`
	Status   leanVMIStatus    `json:"status"`
}

func (l *leanVMI) fill(vmi *kubevirtv1.VirtualMachineInstance) {
	l.Metadata.fill(&vmi.ObjectMeta)
	l.Spec.fill(&vmi.Spec)
	st := &vmi.Status
	st.Phase, st.ActivePods = l.Status.Phase, l.Status.ActivePods
	if l.Status.Conditions != nil {
		st.Conditions = make([]kubevirtv1.VirtualMachineInstanceCondition, len(l.Status.Conditions))
		for i, c := range l.Status.Conditions {
			st.Conditions[i] = kubevirtv1.VirtualMachineInstanceCondition{Type: c.Type, Status: c.Status, Reason: c.Reason}
		}
	}
	st.VolumeStatus = leanVolumeStatuses(l.Status.VolumeStatus)
	if m := l.Status.MigrationState; m != nil {
		st.MigrationState = &kubevirtv1.VirtualMachineInstanceMigrationState{
			StartTimestamp: m.StartTimestamp, EndTimestamp: m.EndTimestamp, TargetNode: m.TargetNode, SourceNode: m.SourceNode}
	}
}

func leanVolumeStatuses(in []leanVolumeStatus) []kubevirtv1.VolumeStatus {
	if in == nil {
		return nil
	}
	out := make([]kubevirtv1.VolumeStatus, len(in))
	for i := range in {
		in, out := &in[i], &out[i]
		out.Name, out.Target, out.Phase, out.Reason, out.Message = in.Name, in.Target, in.Phase, in.Reason, in.Message
		if p := in.PersistentVolumeClaimInfo; p != nil {
			out.PersistentVolumeClaimInfo = &kubevirtv1.PersistentVolumeClaimInfo{ClaimName: p.ClaimName}
		}
		if h := in.HotplugVolume; h != nil {
			out.HotplugVolume = &kubevirtv1.HotplugVolumeStatus{AttachPodName: h.AttachPodName, AttachPodUID: h.AttachPodUID}
		}
	}
	return out
}

type leanDisk struct {
	Name string `json:"name"`
}

type leanDevices struct {
	Disks []leanDisk `json:"disks"`
}

type leanDomain struct {
	Devices leanDevices `json:"devices"`
}

// leanInstanceSpec is the VMI's spec and the VM template's: a KubeVirt
// type both hold keeps the same fields in both.
type leanInstanceSpec struct {
	Domain  leanDomain   `json:"domain"`
	Volumes []leanVolume `json:"volumes"`
}

func (l *leanInstanceSpec) fill(spec *kubevirtv1.VirtualMachineInstanceSpec) {
	spec.Volumes = leanVolumes(l.Volumes)
	if disks := l.Domain.Devices.Disks; disks != nil {
		spec.Domain.Devices.Disks = make([]kubevirtv1.Disk, len(disks))
		for i, d := range disks {
			spec.Domain.Devices.Disks[i].Name = d.Name
		}
	}
}

type leanTemplate struct {
	Spec leanInstanceSpec `json:"spec"`
}

type leanVMSpec struct {
	Template *leanTemplate `json:"template"`
}

type leanHotplugSource struct {
	PersistentVolumeClaim *leanClaim `json:"persistentVolumeClaim"`
}

type leanAddVolume struct {
	Name         string             `json:"name"`
	VolumeSource *leanHotplugSource `json:"volumeSource"`
}

type leanRemoveVolume struct {
	Name string `json:"name"`
}

type leanVolumeRequest struct {
	AddVolumeOptions    *leanAddVolume    `json:"addVolumeOptions"`
	RemoveVolumeOptions *leanRemoveVolume `json:"removeVolumeOptions"`
}

type leanVMCondition struct {
	Type    kubevirtv1.VirtualMachineConditionType `json:"type"`
	Status  corev1.ConditionStatus                 `json:"status"`
	Reason  string                                 `json:"reason"`
	Message string                                 `json:"message"`
}

type leanVMStatus struct {
	Conditions     []leanVMCondition   `json:"conditions"`
	VolumeRequests []leanVolumeRequest `json:"volumeRequests"`
}

type leanVM struct {
	// Kind only tells a Status answer apart; it is not kept.
	Kind     string       `json:"kind"`
	Metadata leanMeta     `json:"metadata"`
	Spec     leanVMSpec   `json:"spec"`
	Status   leanVMStatus `json:"status"`
}

func (l *leanVM) fill(vm *kubevirtv1.VirtualMachine) {
	l.Metadata.fill(&vm.ObjectMeta)
	if t := l.Spec.Template; t != nil {
		vm.Spec.Template = &kubevirtv1.VirtualMachineInstanceTemplateSpec{}
		t.Spec.fill(&vm.Spec.Template.Spec)
	}
	st := &vm.Status
	if l.Status.Conditions != nil {
		st.Conditions = make([]kubevirtv1.VirtualMachineCondition, len(l.Status.Conditions))
		for i, c := range l.Status.Conditions {
			st.Conditions[i] = kubevirtv1.VirtualMachineCondition{Type: c.Type, Status: c.Status, Reason: c.Reason, Message: c.Message}
		}
	}
	st.VolumeRequests = leanVolumeRequests(l.Status.VolumeRequests)
}

func leanVolumeRequests(in []leanVolumeRequest) []kubevirtv1.VirtualMachineVolumeRequest {
	if in == nil {
		return nil
	}
	out := make([]kubevirtv1.VirtualMachineVolumeRequest, len(in))
	for i, r := range in {
		out := &out[i]
		if a := r.AddVolumeOptions; a != nil {
			out.AddVolumeOptions = &kubevirtv1.AddVolumeOptions{Name: a.Name}
			if s := a.VolumeSource; s != nil {
				out.AddVolumeOptions.VolumeSource = &kubevirtv1.HotplugVolumeSource{PersistentVolumeClaim: s.PersistentVolumeClaim.into()}
			}
		}
		if rm := r.RemoveVolumeOptions; rm != nil {
			out.RemoveVolumeOptions = &kubevirtv1.RemoveVolumeOptions{Name: rm.Name}
		}
	}
	return out
}

// leanResource is one resource's lean decoding, of an object and of a list
// into the resource's kubevirtv1 list type. Both return the JSON's kind,
// which tells the API server's Status answers apart without a second scan
// of a large object.
type leanResource struct {
	resource string
	list     func(data []byte, into runtime.Object) (kind string, decoded bool, err error)
	object   func(data []byte) (obj runtime.Object, kind string, err error)
}

func leanVMIs() leanResource {
	return leanDecoding[leanVMI, kubevirtv1.VirtualMachineInstance]("virtualmachineinstances",
		func(l *kubevirtv1.VirtualMachineInstanceList) (*metav1.ListMeta, *[]kubevirtv1.VirtualMachineInstance) {
			return &l.ListMeta, &l.Items
		})
}

func leanVMs() leanResource {
	return leanDecoding[leanVM, kubevirtv1.VirtualMachine]("virtualmachines",
		func(l *kubevirtv1.VirtualMachineList) (*metav1.ListMeta, *[]kubevirtv1.VirtualMachine) {
			return &l.ListMeta, &l.Items
		})
}

func (l *leanVMI) kindOf() string { return l.Kind }
func (l *leanVM) kindOf() string  { return l.Kind }

// leanDecoding is the leanResource of a lean type L filling the kubevirtv1
// type O, whose list type LT gives access to its metadata and items.
func leanDecoding[L, O any, LP interface {
	*L
	fill(*O)
	kindOf() string
}, OP interface {
	*O
	runtime.Object
}, LT runtime.Object](resource string, parts func(LT) (*metav1.ListMeta, *[]O)) leanResource {
	return leanResource{
		resource: resource,
		list: func(data []byte, into runtime.Object) (string, bool, error) {
			out, ok := into.(LT)
			if !ok {
				return "", false, nil
			}
			var l struct {
				Kind     string          `json:"kind"`
				Metadata metav1.ListMeta `json:"metadata"`
				Items    []L             `json:"items"`
			}
			if err := json.Unmarshal(data, &l); err != nil {
				return l.Kind, true, err
			}
			meta, items := parts(out)
			*meta, *items = l.Metadata, make([]O, len(l.Items))
			for i := range l.Items {
				LP(&l.Items[i]).fill(&(*items)[i])
			}
			return l.Kind, true, nil
		},
		object: func(data []byte) (runtime.Object, string, error) {
			var l L
			if err := json.Unmarshal(data, &l); err != nil {
				return nil, LP(&l).kindOf(), err
			}
			out := new(O)
			LP(&l).fill(out)
			return OP(out), LP(&l).kindOf(), nil
		},
	}
}

// leanCodec is the negotiated serializer of a REST client that only reads
// one kubevirt.io/v1 resource: it decodes JSON lists, objects and watch
// events of it into kubevirtv1 objects with the lean fields only, and the
// API server's Status answers (errors, a watch's ERROR events) in full. It
// encodes nothing: the client only lists and watches.
type leanCodec struct{ res leanResource }

func statusKind() *schema.GroupVersionKind {
	gvk := metav1.SchemeGroupVersion.WithKind("Status")
	return &gvk
}

func (c leanCodec) Decode(data []byte, _ *schema.GroupVersionKind, into runtime.Object) (runtime.Object, *schema.GroupVersionKind, error) {
	var (
		obj     runtime.Object
		kind    string
		decoded = true
		err     error
	)
	switch into := into.(type) {
	case *metav1.WatchEvent:
		// A frame of the watch stream; its object comes back as raw bytes.
		return into, nil, json.Unmarshal(data, into)
	case *metav1.Status:
		return into, statusKind(), json.Unmarshal(data, into)
	case nil:
		obj, kind, err = c.res.object(data)
	default:
		obj = into
		kind, decoded, err = c.res.list(data, into)
	}
	if kind == "Status" {
		// Its string status does not fit the lean type: the error above
		// is that mismatch.
		st := &metav1.Status{}
		return st, statusKind(), json.Unmarshal(data, st)
	}
	if !decoded {
		return nil, nil, fmt.Errorf("the lean %s decoder does not decode into %T", c.res.resource, into)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("decode %s: %w", c.res.resource, err)
	}
	gvk := kubevirtv1.SchemeGroupVersion.WithKind(kind)
	return obj, &gvk, nil
}

func (c leanCodec) Encode(obj runtime.Object, _ io.Writer) error {
	return fmt.Errorf("the lean %s client sends no objects (asked to encode %T)", c.res.resource, obj)
}

func (c leanCodec) Identifier() runtime.Identifier {
	return runtime.Identifier("lean-kubevirt-json-" + c.res.resource)
}

func (c leanCodec) SupportedMediaTypes() []runtime.SerializerInfo {
	return []runtime.SerializerInfo{{
		MediaType: runtime.ContentTypeJSON, MediaTypeType: "application", MediaTypeSubType: "json", EncodesAsText: true,
		Serializer: c, StreamSerializer: &runtime.StreamSerializerInfo{EncodesAsText: true, Serializer: c, Framer: kjson.Framer},
	}}
}

func (c leanCodec) EncoderForVersion(e runtime.Encoder, _ runtime.GroupVersioner) runtime.Encoder {
	return e
}

func (c leanCodec) DecoderToVersion(d runtime.Decoder, _ runtime.GroupVersioner) runtime.Decoder {
	return d
}

// leanClient is a REST client of one kubevirt.io/v1 resource of the host
// that decodes with leanCodec. It is its own client, not a typed one, so its
// watches go through client-go's own watch request (retries, warnings, no
// client-side rate limit) with only the decoder replaced.
func leanClient(cfg *rest.Config, res leanResource) (rest.Interface, error) {
	cfg = rest.CopyConfig(cfg)
	gv := kubevirtv1.SchemeGroupVersion
	cfg.GroupVersion, cfg.APIPath = &gv, "/apis"
	cfg.ContentType, cfg.AcceptContentTypes = runtime.ContentTypeJSON, runtime.ContentTypeJSON
	cfg.NegotiatedSerializer = leanCodec{res: res}
	rc, err := rest.RESTClientFor(cfg)
	if err != nil {
		return nil, fmt.Errorf("host client for %s: %w", res.resource, err)
	}
	return rc, nil
}

// leanListWatch lists and watches one resource of the namespace through a
// leanClient; newList makes the resource's kubevirtv1 list.
func leanListWatch(rc rest.Interface, namespace, resource string, newList func() runtime.Object) *cache.ListWatch {
	req := func(o metav1.ListOptions) *rest.Request {
		var timeout time.Duration
		if o.TimeoutSeconds != nil {
			timeout = time.Duration(*o.TimeoutSeconds) * time.Second
		}
		return rc.Get().Namespace(namespace).Resource(resource).VersionedParams(&o, metav1.ParameterCodec).Timeout(timeout)
	}
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			list := newList()
			if err := req(o).Do(ctx).Into(list); err != nil {
				return nil, err
			}
			return list, nil
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.Watch = true
			return req(o).Watch(ctx)
		},
	}
}
